"""The shard task (model queues): run one range of a batch's requests on the process's host.

:func:`run_shard` loads the shard and its batch, claims it (fencing off older attempts),
discards uncommitted chunks, runs the rest (:class:`~worker.shards.run.ShardRun`) and ends it,
finishing the batch or releasing the next shard. The database protocol is
:mod:`worker.shards.state`. A shard's path and its crash recovery: ``docs/worker.md``.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from celery.exceptions import Reject
from celery.signals import worker_ready

from core.broker.queue import TASK_RUN_SHARD, model_queue
from core.database.lifecycle import BatchStatus, ShardStatus
from core.database.sessions import session_scope
from core.database.tables import Batch, Shard
from core.llms.gguf import ModelSourceError
from core.observability import metrics
from core.observability.logs import bind_log_context, log_context
from core.settings import get_settings
from worker.host_contract import Host
from worker.infra import app, input_key, past_expiry, retrying, runtime, storage
from worker.infra.drain import Drain, process_drain
from worker.shards.checkpoints import (
    committed_lines,
    discard_uncommitted,
)
from worker.shards.recovery import fail_claimed
from worker.shards.release import release_next
from worker.shards.run import ShardRun
from worker.shards.state import (
    ShardLost,
    abandon,
    claim,
    finalize_if_idle,
    finish_if_last,
    hand_back,
    handbacks,
    set_shard_status,
    unrelease_paused,
)

logger = logging.getLogger(__name__)


class ModelUnavailable(Exception):
    """This process could not load the model a shard needs; the shard was not claimed."""

    def __init__(self, model: str, cause: BaseException) -> None:
        super().__init__(f"model {model} could not be loaded here: {cause!r}")
        self.model = model


class WorkerDraining(Exception):
    """This worker drains (SIGTERM): the shard was not claimed; its message goes back."""


# How long a shard whose model could not be loaded waits before its task is tried again.
MODEL_RETRY_S = 30.0
# How long a draining worker tries to send a handed-back shard's task (the reclaim sweep
# sends it again after ``resend_after_s()`` if this fails).
HAND_BACK_SEND_S = 5.0
HAND_BACK_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                          "interval_max": 1.0}  # fmt: skip


class ShardEnd(StrEnum):
    """How one :func:`run_shard` call ended."""

    DONE = "done"  # every request of the shard has its line
    STOPPED = "stopped"  # its batch was cancelled or expired: it kept what had finished
    FAILED = "failed"  # past max_shard_attempts: its unfinished requests became error lines
    SKIPPED = "skipped"  # nothing to run: gone, ended, claimed elsewhere or batch not running
    LOST = "lost"  # a newer attempt took the shard over meanwhile
    HANDED_BACK = "handed back"  # the worker drained: pending again, its task sent again
    PAUSED = "paused"  # its batch was paused: pending again, released when the batch resumes


@dataclass
class ShardOutcome:
    """What one :func:`run_shard` call did."""

    end: ShardEnd
    ran: int = 0  # requests this attempt ran
    chunks: int = 0  # the shard's committed chunks when it ended


def _load(shard_id: int) -> tuple[Shard, Batch, str] | None:
    def attempt() -> tuple[Shard, Batch, str] | None:
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            batch = session.get(Batch, shard.batch_id) if shard is not None else None
            if shard is None or batch is None:
                return None
            key = input_key(session, batch)
            session.expunge_all()
        return shard, batch, key

    return retrying(attempt, f"reading shard {shard_id}")


def run_shard(
    shard_id: int,
    *,
    worker: str | None = None,
    host: Host | None = None,
    after_commit: Callable[[int], None] | None = None,
    drain: Drain | None = None,
) -> ShardOutcome:
    """Run (or resume) one shard; see the module docstring. ``host`` defaults to the
    process-wide engine host for the batch's model, ``drain`` to the process's drain; raise
    :class:`WorkerDraining` instead of claiming the shard once the drain has begun."""
    worker = worker or f"{socket.gethostname()}:{threading.get_ident()}"
    worker = f"{worker}:{uuid.uuid4().hex[:8]}"  # one token per attempt (see claim)
    with log_context(shard_id=shard_id, batch_id=None):
        return _run_shard(shard_id, worker, host, after_commit, drain or process_drain())


def _run_shard(
    shard_id: int,
    worker: str,
    host: Host | None,
    after_commit: Callable[[int], None] | None,
    drain: Drain,
) -> ShardOutcome:
    """Load, claim, resume, run, finish: each step below, in that order."""
    loaded = _load(shard_id)
    if loaded is None:
        logger.warning("shard %s is gone", shard_id)
        return ShardOutcome(ShardEnd.SKIPPED)
    shard, batch, key = loaded
    bind_log_context(batch_id=batch.id)
    if _paused(shard, batch):
        # Released before the pause took it back: its slot goes to another batch now.
        if unrelease_paused(shard.id):
            release_next(batch.model)
        return ShardOutcome(ShardEnd.SKIPPED)
    if not _runnable(shard, batch):
        # A redelivered task of a finished shard finishes the batch; any other helps finalize.
        redelivered = shard.status == ShardStatus.DONE and batch.status == BatchStatus.IN_PROGRESS
        _finish(batch, done=redelivered)
        return ShardOutcome(ShardEnd.SKIPPED)
    if host is None:
        host = _host(batch)
    if drain.started:
        raise WorkerDraining(f"shard {shard_id} not claimed: this worker drains")
    claimed = _claim(shard, batch, worker)
    if claimed is None:
        return ShardOutcome(ShardEnd.SKIPPED)
    attempt, num_chunks = claimed
    max_attempts = get_settings().max_shard_attempts
    # A hand-back (a drained worker) is no failure: only the other attempts count.
    if attempt > max_attempts and (failed := attempt - 1 - handbacks(shard_id)) >= max_attempts:
        fail_claimed(
            shard_id,
            attempt,
            num_chunks,
            f"The shard holding this request failed {failed} times "
            f"(max_shard_attempts={max_attempts}); its unfinished requests are reported as "
            "errors",
        )
        return ShardOutcome(ShardEnd.FAILED)
    done_lines = _resume(shard, attempt, num_chunks)
    run = ShardRun(shard, batch, key, attempt, num_chunks, done_lines, host, after_commit, drain)
    status = _run(run)
    if status == ShardStatus.PENDING:
        return _hand_back(run)
    if status is None or not set_shard_status(shard_id, attempt, status):
        return ShardOutcome(ShardEnd.LOST, run.ran, run.chunk)
    logger.info("shard %s attempt %s %s: %s requests run", shard_id, attempt, status, run.ran)
    _finish(batch, done=status == ShardStatus.DONE)
    end = ShardEnd.DONE if status == ShardStatus.DONE else ShardEnd.STOPPED
    return ShardOutcome(end, run.ran, run.chunk)


def _paused(shard: Shard, batch: Batch) -> bool:
    """Whether the shard waits for its paused batch to resume (a shard running elsewhere is
    that attempt's to stop)."""
    return (
        batch.paused_at is not None
        and batch.status == BatchStatus.IN_PROGRESS
        and shard.status == ShardStatus.PENDING
    )


def _runnable(shard: Shard, batch: Batch) -> bool:
    """Whether the shard has requests to run: not ended, in a batch that runs and has time."""
    return not (
        shard.status in (ShardStatus.DONE, ShardStatus.CLOSED, ShardStatus.STOPPED)
        or batch.status != BatchStatus.IN_PROGRESS
        or past_expiry(batch.expires_at)
    )


def _host(batch: Batch) -> Host:
    """The process's host for the batch's model. Loaded before the claim: a model that cannot
    load here costs the shard no attempt (it waits for this or another worker), and never
    turns its requests into shard_failed lines."""
    try:
        return runtime.host(batch.model or "")
    except Exception as exc:
        raise ModelUnavailable(batch.model or "", exc) from exc


def _claim(shard: Shard, batch: Batch, worker: str) -> tuple[int, int] | None:
    """Claim the shard for this attempt: ``(attempt, committed chunks)``, or None (another
    attempt holds it, or it ended meanwhile: the batch may need finalizing)."""
    claimed = claim(shard.id, worker)
    if claimed is None:
        finalize_if_idle(batch.id)
        return None
    if claimed[0] == 1 and shard.released_at is not None:
        metrics.observe_queue_wait(batch.model or "", shard.released_at)
    return claimed


def _resume(shard: Shard, attempt: int, num_chunks: int) -> set[int]:
    """Delete the chunks an earlier attempt wrote but never committed; the lines done."""
    sto = storage()
    discarded = discard_uncommitted(sto, shard.batch_id, shard.index, num_chunks)
    done_lines = committed_lines(sto, shard.batch_id, shard.index, num_chunks)
    if discarded or done_lines:
        logger.info(
            "shard %s attempt %s resumes: %s lines done, %s uncommitted chunks discarded",
            shard.id,
            attempt,
            len(done_lines),
            discarded,
        )
    return done_lines


def _run(run: ShardRun) -> ShardStatus | None:
    """Run the attempt: the shard's status at its end, or None when a newer attempt took the
    shard over."""
    try:
        return run.run()
    except ShardLost as lost:
        logger.warning("shard %s attempt %s stops: %s", run.shard.id, run.attempt, lost)
        return None
    except BaseException:
        # Leave the shard running but mark it abandoned (no heartbeat): a redelivered task
        # may claim it at once, the reclaim sweep re-queues it on its next pass, and a cancel
        # does not wait for it. Either resumes from the last committed checkpoint.
        logger.exception("shard %s attempt %s failed", run.shard.id, run.attempt)
        abandon(run.shard.id, run.attempt)
        raise


def _hand_back(run: ShardRun) -> ShardOutcome:
    """The worker drained before the shard's end: make it pending again, its checkpoints
    kept, and send its task, so another worker resumes it now (no wait for its heartbeat to go
    stale). The next claim raises ``attempts``, which fences this attempt off."""
    shard_id = run.shard.id
    if run.pausing and not run.drain.started:
        return _pause(run)
    if not hand_back(shard_id, run.attempt):
        return ShardOutcome(ShardEnd.LOST, run.ran, run.chunk)
    logger.info(
        "shard %s attempt %s handed back (this worker drains): %s requests run, %s chunks "
        "committed",
        shard_id,
        run.attempt,
        run.ran,
        run.chunk,
    )
    try:
        retrying(
            lambda: app.send_task(
                TASK_RUN_SHARD,
                args=[shard_id],
                queue=model_queue(run.model),
                retry_policy=HAND_BACK_RETRY_POLICY,
            ),
            f"sending handed-back shard {shard_id}",
            patience_s=HAND_BACK_SEND_S,
        )
    except Exception:
        logger.exception("handed-back shard %s not sent; the reclaim sweep sends it", shard_id)
    return ShardOutcome(ShardEnd.HANDED_BACK, run.ran, run.chunk)


def _pause(run: ShardRun) -> ShardOutcome:
    """The batch was paused before the shard's end: make it pending again, its checkpoints
    kept, out of the release window (the resume releases it again), and release the model's
    next shard into the freed slot."""
    if not hand_back(run.shard.id, run.attempt, unrelease=True):
        return ShardOutcome(ShardEnd.LOST, run.ran, run.chunk)
    logger.info(
        "shard %s attempt %s handed back (its batch is paused): %s requests run, %s chunks "
        "committed",
        run.shard.id,
        run.attempt,
        run.ran,
        run.chunk,
    )
    release_next(run.model)
    return ShardOutcome(ShardEnd.PAUSED, run.ran, run.chunk)


def _finish(batch: Batch, *, done: bool) -> None:
    """After a shard ends: finish the batch if it was the last (``done``); otherwise finalize
    it once no shard runs if it is stopping. A shard that ran to its end before it saw a
    cancel or an expiry asks that too: it may be the last running shard of a stopping batch,
    whose cancel found it running and left its finalize to the last shard to end. Then
    release the model's next shard into the freed slot."""
    if not (done and finish_if_last(batch.id)):
        finalize_if_idle(batch.id)
    release_next(batch.model)


@app.task(name=TASK_RUN_SHARD, bind=True)
def run_shard_task(self: Any, shard_id: int) -> None:
    try:
        run_shard(int(shard_id), worker=f"{self.request.hostname}:{threading.get_ident()}")
    except WorkerDraining as exc:
        # Back on the queue for a worker that stays (a draining one consumes no more).
        raise Reject(str(exc), requeue=True) from None
    except ModelUnavailable as exc:
        # Tried again later, here or by another worker of the queue, never counted against
        # the shard: its batch is not ended with every line failed by a worker without it.
        logger.error("shard %s waits: %s", shard_id, exc)
        raise self.retry(exc=exc, countdown=MODEL_RETRY_S, max_retries=None) from None


@worker_ready.connect
def _load_served_models(sender: Any = None, **_: Any) -> None:
    """Load the engine of every model whose queue this worker consumes, once, at start."""
    try:
        consumed = set(sender.app.amqp.queues.consume_from or ())
    except Exception:
        return
    models = [m for m in get_settings().models if model_queue(m) in consumed]
    if not models:
        return

    def load() -> None:
        for model in models:
            try:
                runtime.host(model)
            except ModelSourceError:
                pass  # logged as refused, naming the model and its file
            except Exception:
                logger.exception("could not load model %s", model)

    threading.Thread(target=load, name="batchd-model-loader", daemon=True).start()
