"""A question to the control worker that waits for its answer, over the broker (any kombu
transport). Tasks have no result backend, so a caller that needs an answer (an estimate: only
the control worker holds the tokenizers) sends the task with a reply queue of its own::

    answer = call(TASK_ESTIMATE, key, endpoint, timeout=60)   # the API
    reply(reply_to, deadline, {"ok": ...})                     # the task, at its end

The reply queue is deleted when the caller stops waiting, and the task expires at the deadline
and sends nothing after it, so no answer is ever left in the broker."""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import suppress
from typing import Any

from core.broker.queue import CONTROL_QUEUE, _producer

logger = logging.getLogger(__name__)

REPLY_PREFIX = "batchd.reply."


class NoAnswer(TimeoutError):
    """The control worker did not answer within the timeout."""


def _broker(broker_url: str | None) -> str:
    if broker_url is not None:
        return broker_url
    from core.settings import get_settings

    return get_settings().broker_url


def call(task: str, *args: Any, timeout: float, broker_url: str | None = None) -> Any:
    """Send ``task(*args, reply_to, deadline)`` to the control queue and return the payload
    its :func:`reply` sends; :class:`NoAnswer` after ``timeout`` seconds."""
    app = _producer(_broker(broker_url))
    reply_to = REPLY_PREFIX + uuid.uuid4().hex
    deadline = time.time() + timeout
    with app.connection_for_write() as conn:
        replies = conn.SimpleQueue(reply_to, no_ack=True, serializer="json")
        try:
            # The reply queue exists before the task can answer.
            app.send_task(
                task, args=[*args, reply_to, deadline], queue=CONTROL_QUEUE, expires=timeout
            )
            try:
                return replies.get(block=True, timeout=timeout).payload
            except replies.Empty:
                raise NoAnswer(f"no answer to {task} within {timeout:g} seconds") from None
        finally:
            with suppress(Exception):
                replies.queue.delete()
            replies.close()


def reply(reply_to: str, deadline: float, payload: Any, broker_url: str | None = None) -> bool:
    """Answer a :func:`call`; False (nothing sent) when its caller has stopped waiting."""
    if not reply_to.startswith(REPLY_PREFIX):
        raise ValueError(f"not a reply queue: {reply_to!r}")
    if time.time() > deadline:
        logger.warning("the answer to %s came after its caller stopped waiting", reply_to)
        return False
    app = _producer(_broker(broker_url))
    with app.connection_for_write() as conn:
        replies = conn.SimpleQueue(reply_to, serializer="json")
        try:
            replies.put(payload)
        finally:
            replies.close()
    return True
