"""Control tasks of the projections: an estimate of an input file (validated and counted
exactly as the validate task does, nothing created) answered to the API that asked, and the
beat task that refreshes every running batch's projected completion (``core.eta.store``)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from core.broker import request_reply
from core.broker.queue import TASK_ESTIMATE, TASK_REFRESH_ETAS
from core.database.lifecycle import now
from core.database.sessions import session_scope
from core.eta import store
from core.settings import get_settings
from worker.infra import app
from worker.validation.failures import validation_errors
from worker.validation.scan import CallerGone, scan_input

logger = logging.getLogger(__name__)


def scan_file(key: str, endpoint: str, deadline: float | None = None) -> dict[str, Any]:
    """What validation finds in the stored file ``key``: request counts, the errors the
    batch would fail with, its model, and its exact prompt tokens and estimated tokens
    (prompt + output bounds, the unit of shards and of the projections). Stops with
    :class:`~worker.validation.scan.CallerGone` past ``deadline``."""
    scan = scan_input(key, endpoint, deadline)
    report = scan.report
    est_tokens = sum(spec.est_tokens for spec in scan.planner.finish())
    return {
        "total_requests": report.num_requests + report.num_invalid,
        "valid_requests": report.num_requests,
        "errors": validation_errors(report),
        "truncated": report.truncated,
        "model": report.model,
        "prompt_tokens": scan.prompt_tokens,
        "est_tokens": est_tokens,
        "max_completion_tokens": max(0, est_tokens - scan.prompt_tokens),
        "predicted_shareable_tokens": scan.shareable_tokens,
    }


_scans: threading.BoundedSemaphore | None = None
_scans_lock = threading.Lock()


def _scan_slots() -> threading.BoundedSemaphore:
    global _scans
    with _scans_lock:
        if _scans is None:
            _scans = threading.BoundedSemaphore(get_settings().estimate_scans_per_worker)
        return _scans


@app.task(name=TASK_ESTIMATE, acks_late=False)
def estimate_task(key: str, endpoint: str, reply_to: str, deadline: float) -> None:
    """Scan the file and answer the caller (``core.broker.request_reply.call``). Not redelivered
    after a worker dies (``acks_late`` off): its caller has stopped waiting by then. A scan whose
    caller has gone (its deadline passed, before or while it reads) stops: a flood of
    estimates nobody waits for does not keep the control worker reading files. At most
    ``estimate_scans_per_worker`` scans run in a worker at once (fewer than its control
    threads): the next is answered busy at once, so estimates never take every thread that
    validates, finalizes and cancels."""
    slots = _scan_slots()
    if not slots.acquire(blocking=False):
        request_reply.reply(reply_to, deadline, {"ok": False, "busy": True})
        return
    try:
        payload: dict[str, Any] = {"ok": True, **scan_file(key, endpoint, deadline)}
    except CallerGone as gone:
        logger.warning("estimate of %s dropped: %s", key, gone)
        return
    except Exception as exc:
        logger.exception("estimating %s failed", key)
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        slots.release()
    request_reply.reply(reply_to, deadline, payload)


def refresh_etas() -> int:
    with session_scope() as session:
        return store.refresh(session, now(), get_settings().throughput_window_s)


@app.task(name=TASK_REFRESH_ETAS)
def refresh_etas_task(**_: Any) -> None:
    refresh_etas()
