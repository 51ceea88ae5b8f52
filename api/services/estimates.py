"""A batch's estimate: what a create would make of its file, and when it would be done.

The control worker reads the file as validation would (``worker.validation.estimate``, over the
broker: ``core.broker.request_reply``); the times come from the work queued ahead and the model's
recent throughput (``core.eta.store``). Without recent throughput the times are null and ``reason``
says why: nothing is guessed, and nothing is created.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError
from api.schemas import BatchCreate, BatchErrorItem, BatchEstimate, ModelEstimate, unix
from api.services.batches import batch_input_file, checked_priority, checked_window_s
from core.batches.priority import PriorityName
from core.broker import request_reply
from core.broker.queue import TASK_ESTIMATE
from core.database.lifecycle import now
from core.eta import store
from core.settings import Settings

log = logging.getLogger("batchd.api")


_waiting: collections.Counter[str] = collections.Counter()  # estimates per tenant, now
_waiting_lock = threading.Lock()


@contextmanager
def _estimate_slot(tenant: str, limit: int) -> Iterator[None]:
    """One of the tenant's ``limit`` estimates at a time in this process, else 429: one
    tenant's flood of estimates holds no more API threads or control-worker scans."""
    with _waiting_lock:
        if _waiting[tenant] >= limit:
            raise APIError(
                429,
                f"This tenant already has {_waiting[tenant]} estimates waiting, the limit "
                f"(max_estimates_per_tenant={limit}); wait for one to answer, then retry.",
                code="too_many_estimates",
                headers={"retry-after": "1"},
            )
        _waiting[tenant] += 1
    try:
        yield
    finally:
        with _waiting_lock:
            _waiting[tenant] -= 1
            if _waiting[tenant] <= 0:
                del _waiting[tenant]


#: Threads that wait for control workers' scans, apart from the server's pool: a route that
#: waits up to ``estimate_timeout_s`` must not hold the threads every other call runs on (45
#: waiting estimates took /healthz from 0.18 s to 10 s).
ESTIMATE_WAITERS = 32
_waiters: anyio.CapacityLimiter | None = None


def _waiter_threads() -> anyio.CapacityLimiter:
    global _waiters
    if _waiters is None:
        _waiters = anyio.CapacityLimiter(ESTIMATE_WAITERS)
    return _waiters


async def estimate_batch(
    session: Session, settings: Settings, caller: Caller, body: BatchCreate
) -> BatchEstimate:
    """The estimate of a create with ``body``, checked as that create would be. The checks
    and the answer's queries run in the server's thread pool; the wait for the scan runs on
    threads of its own (:data:`ESTIMATE_WAITERS`)."""
    priority, seconds, key = await run_in_threadpool(_checked, session, settings, caller, body)
    with _estimate_slot(caller.tenant, settings.max_estimates_per_tenant):
        scan = await anyio.to_thread.run_sync(
            _scan, key, body.endpoint, settings, limiter=_waiter_threads()
        )
    return await run_in_threadpool(
        build_estimate, session, settings, body, caller.tenant, priority, seconds, scan
    )


def _checked(
    session: Session, settings: Settings, caller: Caller, body: BatchCreate
) -> tuple[PriorityName, int, str]:
    priority = checked_priority(body, caller)
    seconds = checked_window_s(body.completion_window, caller, settings)
    input_file = batch_input_file(session, caller.tenant, body.input_file_id)
    key = input_file.storage_key
    session.commit()  # no connection held while the control worker reads the file
    return priority, seconds, key


def _scan(key: str, endpoint: str, settings: Settings) -> dict[str, Any]:
    try:
        answer = request_reply.call(
            TASK_ESTIMATE, key, endpoint, timeout=settings.estimate_timeout_s
        )
    except request_reply.NoAnswer as error:
        raise APIError(
            503,
            f"No control worker read the file within {settings.estimate_timeout_s:g} seconds "
            "(estimate_timeout_s); the service may be busy or its control worker down. "
            "Retry shortly.",
            code="estimate_unavailable",
        ) from error
    except Exception as error:
        log.error("could not ask for an estimate: %s", error)
        raise APIError(
            503,
            "The task broker is unavailable; please retry shortly.",
            code="broker_unavailable",
        ) from error
    if answer.get("busy"):
        raise APIError(
            503,
            "The control worker is already scanning files for other estimates "
            "(estimate_scans_per_worker); retry in a few seconds.",
            code="estimate_busy",
            headers={"retry-after": "2"},
        )
    if not answer.get("ok"):  # the control worker logged why; internals stay there
        log.error("estimate of %s failed: %s", key, answer.get("error"))
        raise APIError(500, "The file could not be read; the service's logs have the details.")
    return answer


def build_estimate(
    session: Session,
    settings: Settings,
    body: BatchCreate,
    tenant: str,
    priority: PriorityName,
    window_s: int,
    scan: dict[str, Any],
) -> BatchEstimate:
    """The answer, from the control worker's scan and the queue as it is now."""
    created = now()
    deadline = created + timedelta(seconds=window_s)
    model = scan.get("model")
    valid = int(scan["valid_requests"])
    work = float(scan["est_tokens"])
    times = None
    reason: str | None = "The file holds no valid request: there is nothing to run."
    if model and valid:
        times = store.times_for_new_batch(
            session,
            model,
            tenant=tenant,
            priority=priority,
            deadline=deadline.timestamp(),
            work=work,
            now=created,
            window_s=settings.throughput_window_s,
        )
        reason = times.reason
    projection = times.projection if times is not None else None
    per_model = {}
    if model and valid:
        per_model[model] = ModelEstimate(
            requests=valid,
            prompt_tokens=int(scan["prompt_tokens"]),
            max_completion_tokens=int(scan["max_completion_tokens"]),
            throughput_tokens_per_s=None if times is None else times.rate,
        )
    return BatchEstimate(
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        priority=priority,
        model=model,
        total_requests=int(scan["total_requests"]),
        valid_requests=valid,
        errors=[BatchErrorItem(**e) for e in scan["errors"]],
        prompt_tokens=int(scan["prompt_tokens"]),
        max_completion_tokens=int(scan["max_completion_tokens"]),
        predicted_shareable_tokens=int(scan.get("predicted_shareable_tokens", 0)),
        per_model=per_model,
        queue_ahead_tokens=0 if times is None else round(times.ahead.total),
        estimated_start_at=None if projection is None else int(projection.start),
        estimated_completion_at=None if projection is None else int(projection.finish),
        expires_at=unix(deadline) or 0,
        fits_window=None if projection is None else projection.finish <= deadline.timestamp(),
        reason=None if projection is not None else reason,
    )
