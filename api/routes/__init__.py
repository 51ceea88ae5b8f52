"""The API's routers, one per OpenAI resource."""
