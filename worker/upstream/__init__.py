"""Upstream models: the dispatcher that stands in for the engine host and sends each request to
an OpenAI-compatible server, and the shard handler that submits to it."""
