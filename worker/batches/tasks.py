"""Control-queue tasks: validate, finalize, cancel and the expiry sweep.

Every task re-reads the batch and acts only if the world still calls for it; each status change
is one conditional UPDATE (:func:`core.database.lifecycle.transition`) that one actor wins. No
failure strands a batch: a step that raises is retried and, past ``control_task_max_attempts``,
fails the batch naming the error (:func:`run_control_step`). Validation streams into execution
(:mod:`worker.validation.task`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from sqlalchemy import select

from core.broker.queue import TASK_CANCEL, TASK_FINALIZE, TASK_SWEEP_EXPIRED, TASK_VALIDATE
from core.database.lifecycle import UNFINISHED, BatchStatus, now, transition
from core.database.sessions import session_scope
from core.database.tables import Batch
from core.observability.logs import log_context
from core.settings import get_settings
from worker.batches.finalize import finalize
from worker.events import notify
from worker.infra import (
    app,
    input_key,
    live_shards,
    send,
    stale_after_s,
    transient_error,
)
from worker.validation.failures import (
    enqueued_tokens,
    fail_running,
    quota_error,
)
from worker.validation.task import StreamedValidation, ValidationStop, progress

__all__ = [
    "cancel",
    "enqueued_tokens",
    "quota_error",
    "run_control_step",
    "sweep_expired",
    "validate",
]

logger = logging.getLogger(__name__)


def validate(batch_id: str) -> str | None:
    """Validate the batch's input file, creating and releasing each shard as soon as its
    lines are validated (:mod:`worker.validation.task`); return the batch's status when the
    validation ended (``in_progress`` or ``failed``), or what a finalize made of a batch
    cancelled or expired meanwhile.

    A batch ``validating``, or ``in_progress`` with its validation not done (the task ran
    before and stopped: a retry, a redelivery, the reclaim sweep), is validated from where its
    shards end; any other batch is left alone."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            logger.warning("validate: batch %s is gone", batch_id)
            return None
        if batch.status == BatchStatus.CANCELLING:
            return finalize(batch_id)
        resuming = batch.status == BatchStatus.IN_PROGRESS and not batch.validation_done
        if batch.status != BatchStatus.VALIDATING and not resuming:
            return None  # someone else got here first
        run = StreamedValidation(
            batch_id,
            input_key(session, batch),
            batch.endpoint,
            batch.tenant,
            progress(session, batch_id) if resuming else None,
        )
    outcome = run.run()
    if outcome == ValidationStop.OVERTAKEN:
        return None
    if outcome == ValidationStop.BATCH_ENDED:
        # The batch was cancelled (or expired) while it was being validated.
        return finalize(batch_id)
    return outcome


def cancel(batch_id: str) -> str | None:
    """Finish a cancel now if no shard is running; otherwise the running shards notice within
    about a second, abort their requests and the last one to stop enqueues the finalize."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.CANCELLING:
            return None
        running = live_shards(session, batch_id)
    if running:
        logger.info("batch %s: waiting for %s running shards to stop", batch_id, running)
        return None
    return finalize(batch_id)


def sweep_expired() -> int:
    """End batches past their completion window; also re-drive cancels whose shards died."""
    current = now()
    with session_scope() as session:
        rows = session.execute(
            select(Batch.id, Batch.status, Batch.cancelling_at)
            .where(Batch.status.in_(UNFINISHED))
            .where((Batch.expires_at <= current) | (Batch.status == BatchStatus.CANCELLING))
        ).all()
    sent = 0
    for batch_id, status, cancelling_at in rows:
        recent = cancelling_at is not None and (current - cancelling_at).total_seconds() < (
            stale_after_s()
        )
        if status == BatchStatus.CANCELLING and recent:
            continue
        send(TASK_FINALIZE, batch_id)
        sent += 1
    return sent


STEP_NAMES = {"validate": "Validating", "finalize": "Finalizing", "cancel": "Cancelling"}
# The statuses a control step that gave up moves to ``failed`` (a cancelling batch cannot fail:
# the expiry sweep re-drives its finalize). A validate gives up on an in_progress batch only
# while its validation is not done (worker.validation.failures.fail_running).
GIVE_UP_FROM = {
    "validate": (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
    "finalize": (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
    "cancel": (),
}


def retry_delay_s(attempt: int) -> float:
    """The wait before run ``attempt + 1`` of a control task: doubling, at most a minute,
    with jitter so batches that failed together do not retry in lockstep."""
    base = get_settings().control_task_retry_delay_s * 2 ** (attempt - 1)
    return min(60.0, base) * (0.75 + random.random() / 2)


def _describe(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def task_failed_error(step: str, attempts: int, exc: BaseException) -> dict[str, Any]:
    """The ``errors`` entry of a batch whose control step kept raising."""
    return {
        "code": "server_error",
        "message": f"{STEP_NAMES[step]} the batch failed {attempts} times; the last error was "
        f"{_describe(exc)}. Please create the batch again.",
        "param": None,
        "line": None,
    }


def give_up(batch_id: str, step: str, attempts: int, exc: BaseException) -> bool:
    """Fail the batch of a control step that kept raising; True if this call failed it."""
    sources = GIVE_UP_FROM[step]
    if not sources:
        return False
    error = task_failed_error(step, attempts, exc)
    if step == "validate":
        # Validating, or in_progress with shards streamed so far: it fails with its shards
        # stopped and nothing of it shown (worker.validation.task), and sends its webhook event.
        won = fail_running(batch_id, error)
    else:
        with session_scope() as session:
            won = transition(session, batch_id, sources, BatchStatus.FAILED, errors=[error])
        if won:
            notify(batch_id, BatchStatus.FAILED)
    if won:
        logger.error("batch %s failed: %s the batch failed %s times", batch_id, step, attempts)
    return won


def run_control_step(task: Any, step: str, batch_id: str) -> None:
    """Run ``step`` (validate, finalize or cancel) of ``batch_id`` for the bound Celery
    ``task``. If it raises, the task is retried with backoff, up to
    ``control_task_max_attempts`` runs; then the batch fails with the error named (see
    :func:`give_up`), unless the last error was a database or broker outage: the batch then
    stays as it is and the sweeps send its task again (a batch stuck validating or finalizing:
    the reclaim sweep; one past its window or cancelling: the expiry sweep)."""
    steps = {"validate": validate, "finalize": finalize, "cancel": cancel}
    try:
        steps[step](batch_id)
        return
    except Exception as exc:
        settings = get_settings()
        attempt = task.request.retries + 1
        if attempt < settings.control_task_max_attempts:
            delay = retry_delay_s(attempt)
            logger.warning(
                "%s batch %s failed (run %s of %s): %s; retrying in %.1fs",
                step,
                batch_id,
                attempt,
                settings.control_task_max_attempts,
                _describe(exc),
                delay,
                exc_info=True,
            )
            raise task.retry(exc=exc, countdown=delay) from exc
        if transient_error(exc):
            logger.error(
                "%s batch %s failed %s times (%s); the sweeps send it again",
                step,
                batch_id,
                attempt,
                _describe(exc),
            )
            raise
        logger.exception("%s batch %s failed %s times; giving up", step, batch_id, attempt)
        give_up(batch_id, step, attempt, exc)


@app.task(name=TASK_VALIDATE, bind=True, max_retries=None)
def validate_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "validate", batch_id)


@app.task(name=TASK_FINALIZE, bind=True, max_retries=None)
def finalize_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "finalize", batch_id)


@app.task(name=TASK_CANCEL, bind=True, max_retries=None)
def cancel_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "cancel", batch_id)


@app.task(name=TASK_SWEEP_EXPIRED)
def sweep_expired_task(**_: Any) -> None:
    sweep_expired()
