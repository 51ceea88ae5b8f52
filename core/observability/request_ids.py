"""The id of the API call that caused some work (``x-request-id``), carried into its tasks.

The API accepts a caller's ``x-request-id`` (or makes one) and binds it to the log context as
``http_request_id`` (``request_id`` names the batch line a worker is running). :func:`headers`
puts it on every task the call enqueues, and the task signals below bind it again in the
worker for the task's lines, so one call can be followed from the API's access line to the
validation, shard and finalize lines it led to.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from celery import signals

from core.observability.logs import bind_log_context, current_context

HEADER = "x-request-id"
#: The task header that carries it (a Celery header name, so no dashes).
TASK_HEADER = "x_request_id"
_ACCEPTED = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def accepted_or_new(value: str | None) -> str:
    """A caller's id when it is a sane one (1-128 visible ASCII characters of an id), else a
    fresh ``req_…``: the id ends in log lines and headers, so nothing else is copied there."""
    if value is not None and _ACCEPTED.fullmatch(value):
        return value
    return f"req_{secrets.token_hex(16)}"


def headers() -> dict[str, str]:
    """The task headers that carry the current call's id (none outside a call)."""
    current = current_context().get("http_request_id")
    return {TASK_HEADER: current} if current else {}


def _task_request_id(task: Any) -> str | None:
    request = getattr(task, "request", None)
    if request is None:
        return None
    value = getattr(request, TASK_HEADER, None) or (request.headers or {}).get(TASK_HEADER)
    return value if isinstance(value, str) else None


@signals.task_prerun.connect(weak=False)
def _bind(task: Any = None, **_: Any) -> None:
    bind_log_context(http_request_id=_task_request_id(task))


@signals.task_postrun.connect(weak=False)
def _unbind(**_: Any) -> None:
    bind_log_context(http_request_id=None)
