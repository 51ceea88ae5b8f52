"""The batch a request is about, on every log line emitted while serving it.

``/v1/batches/{batch_id}`` and what lies under it (retrieve, cancel) name their batch in the
path; a create learns its batch's id, and a download of a batch's output or error file its
batch's, only inside the route, which calls :func:`bind_batch`. Either way the id is in
:func:`core.observability.logs.log_context` for the rest of the request: the route's own lines, the
error handlers' (the catch-all 500 handler included: the middleware wraps the whole stack) and
uvicorn's access line, as the worker's lines carry the batch they work on.
"""

from __future__ import annotations

import contextvars
from typing import Any

from fastapi import FastAPI

from api.services.lookups import could_be_id
from core.observability import request_ids, tracing
from core.observability.logs import bind_log_context, log_context

BATCHES_PREFIX = "/v1/batches/"

# The request's mutable record of ids its route learned. Sync routes run in a thread, in a
# copy of the request's context, so a value they set there never reaches the response's
# lines; a change to this shared dict does.
_learned: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "batchd_api_learned_ids", default=None
)


def bind_batch(batch_id: str) -> None:
    """From here to the end of the request, its log lines carry ``batch_id``. Outside a
    request (a service called in-process) nothing is bound: there is no request's end to
    unbind it, and the caller's later lines would carry the batch."""
    learned = _learned.get()
    if learned is not None:
        bind_log_context(batch_id=batch_id)
        learned["batch_id"] = batch_id


def batch_in_path(path: str) -> str | None:
    if not path.startswith(BATCHES_PREFIX):
        return None
    candidate = path[len(BATCHES_PREFIX) :].split("/", 1)[0]
    return candidate if could_be_id(candidate) else None


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class BatchLogContext:
    """ASGI middleware: the request's batch id (from the path, or bound by the route) and its
    ``x-request-id`` (the caller's, or a new one, returned on the response) in the log
    context of everything that serves the request and in the tasks it enqueues."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        learned: dict[str, str] = {}
        path_batch = batch_in_path(scope.get("path", ""))
        request_id = request_ids.accepted_or_new(_header(scope, b"x-request-id"))
        tracing.tag_request_id(request_id)
        anthropic_path = scope.get("path", "").startswith("/v1/messages")

        async def send_with_ids(message: dict[str, Any]) -> None:
            if "batch_id" in learned:
                bind_log_context(batch_id=learned["batch_id"])  # for uvicorn's access line
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("ascii")))
                if anthropic_path:  # where the anthropic SDK reads it (``_request_id``)
                    headers.append((b"request-id", request_id.encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        token = _learned.set(learned)
        try:
            with log_context(batch_id=path_batch, http_request_id=request_id):
                await self.app(scope, receive, send_with_ids)
        finally:
            _learned.reset(token)


def install(app: FastAPI) -> None:
    """Wrap the whole middleware stack, Starlette's outermost error middleware included, so
    the lines of an unhandled error carry the batch too."""
    build = app.build_middleware_stack

    def build_with_log_context() -> Any:
        return BatchLogContext(build())

    app.build_middleware_stack = build_with_log_context  # type: ignore[method-assign]
