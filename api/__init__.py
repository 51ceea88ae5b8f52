"""The HTTP API: OpenAI's Files, Batches and Models routes, batchd's extensions, the dashboard."""
