"""Log records that say which job they are about, and an opt-in JSON format.

Work on a batch, shard or request runs inside :func:`log_context`; a :class:`ContextFilter`
copies its ids into every record (``batch_id``, ``shard_id``, ``request_id`` (the batch line)
and ``http_request_id`` (the API call's: :mod:`core.observability.request_ids`)), so a batch or a
call can be followed across processes. The ids are context variables: each thread and asyncio task
has its own. ``BATCHD_LOG_FORMAT=json`` writes one JSON object per line (:class:`JsonFormatter`)."""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

CONTEXT_FIELDS = ("batch_id", "shard_id", "request_id", "http_request_id")
_vars: dict[str, contextvars.ContextVar[Any]] = {
    name: contextvars.ContextVar(name, default=None) for name in CONTEXT_FIELDS
}


@contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """Records logged inside carry these ids (``batch_id=``, ``shard_id=``, ``request_id=``)."""
    tokens = [(_vars[name], _vars[name].set(value)) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def bind_log_context(**ids: Any) -> None:
    """Set ids inside an enclosing :func:`log_context` that names them (with None, say): its
    exit restores what was there before, so nothing leaks into the thread's next task."""
    for name, value in ids.items():
        _vars[name].set(value)


def current_context() -> dict[str, Any]:
    return {name: var.get() for name, var in _vars.items() if var.get() is not None}


class ContextFilter(logging.Filter):
    """Copies the current ids onto each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _vars.items():
            if not hasattr(record, name):
                setattr(record, name, var.get())
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, process,
    thread, the ids of :func:`log_context` that are set, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is None:
                value = _vars[name].get()
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def install(handlers: Iterable[logging.Handler], log_format: str) -> None:
    """Give ``handlers`` the context filter, and the JSON formatter when ``log_format`` is
    ``json``."""
    for handler in handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
        if log_format == "json":
            handler.setFormatter(JsonFormatter())


def configure_process(log_format: str, loggers: Iterable[str] = ()) -> None:
    """Apply ``log_format`` to the root logger's handlers and those of ``loggers`` (e.g.
    uvicorn's, which do not propagate); a root logger without handlers gets one on stderr."""
    root = logging.getLogger()
    if log_format == "json" and not root.handlers:
        root.addHandler(logging.StreamHandler())
        if root.level == logging.WARNING:
            root.setLevel(logging.INFO)
    install(root.handlers, log_format)
    for name in loggers:
        install(logging.getLogger(name).handlers, log_format)
