"""The shard task (model queues): run one contiguous range of a batch's requests through the
process-wide engine host and checkpoint the results. The database protocol of a shard lives in
:mod:`worker.shard_state`, the loop that feeds the engine in :mod:`worker.shard_run`; this
module wires them into the Celery task.

Flow of :func:`run_shard`:

1. Re-read the shard and its batch. A batch that is no longer ``in_progress`` (cancelled,
   expiring) means: do nothing, but help it finalize if no shard is running any more.
2. Claim the shard: ``pending|running -> running``, ``attempts + 1``, while holding a share
   lock on the batch row, so a cancel either sees this shard running or the claim sees the
   cancel. ``attempts`` fences off any older attempt still alive: its commits stop matching.
3. Delete chunks an earlier attempt wrote but never committed; read the committed ones to
   learn which lines are done; skip those.
4. Feed the remaining requests to the engine host (``group = batch id``, so a cancel aborts
   the whole batch in one call; with the batch's tenant and priority, which the host's fair
   queue shares by). ``submit`` blocks while the batch already holds its window of pending
   requests in the host (``EngineHost.group_window``, one engine's worth of sequences, shared
   by all shards of the batch in this process), which bounds memory and keeps a bulk batch
   from queueing ahead of others; it is called with a short timeout so the loop keeps
   checkpointing and watching the batch status meanwhile.
5. Every ``checkpoint_every`` results or ``checkpoint_interval_s`` seconds: write a chunk
   (atomic), then in one transaction advance ``num_chunks``/``done_requests`` conditionally
   and add to the batch's live counters.
6. Done: mark the shard ``done``; the shard that finds no unfinished shard left moves the
   batch to ``finalizing`` (one conditional UPDATE: one winner) and enqueues the finalize.
   Cancelled or expired: abort the group, checkpoint what finished, mark the shard
   ``stopped``; the last one to stop enqueues the finalize.

Per-request failures (a prompt too long for the model, bad sampling values, an engine error
for that request) become error-file lines; they never fail the shard. A request whose engine
step failed is retried alone (see :class:`ShardRun`), up to ``max_request_attempts`` times.

Crash recovery: while an attempt runs, a background thread stamps ``heartbeat_at`` every
``heartbeat_interval_s``. A worker killed outright stops heartbeating; the reclaim sweep
(:mod:`worker.recovery`) re-queues its shard after ``shard_stale_after_s``, and the new
attempt resumes from the last committed checkpoint. A shard claimed more than
``max_shard_attempts`` times has its remaining requests reported as ``shard_failed`` error
lines. Every database step retries through a short database outage (``common.retrying``).
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_ready

from core import metrics
from core.db import session_scope
from core.lifecycle import BatchStatus, ShardStatus
from core.llms.gguf import ModelSourceError
from core.logs import bind_log_context, log_context
from core.queue import TASK_RUN_SHARD, model_queue
from core.settings import get_settings
from core.tables import Batch, Shard
from worker import runtime
from worker.celery_app import app
from worker.checkpoints import (
    committed_lines,
    discard_uncommitted,
)
from worker.common import input_key, past_expiry, retrying, storage
from worker.recovery import fail_claimed
from worker.release import release_next
from worker.shard_run import ShardRun
from worker.shard_state import (
    ShardLost,
    abandon,
    claim,
    finalize_if_idle,
    finish_if_last,
    set_shard_status,
)

logger = logging.getLogger(__name__)


class ModelUnavailable(Exception):
    """This process could not load the model a shard needs; the shard was not claimed."""

    def __init__(self, model: str, cause: BaseException) -> None:
        super().__init__(f"model {model} could not be loaded here: {cause!r}")
        self.model = model


# How long a shard whose model could not be loaded waits before its task is tried again.
MODEL_RETRY_S = 30.0


@dataclass
class ShardOutcome:
    status: str  # done | stopped | failed | skipped | lost
    ran: int = 0
    chunks: int = 0


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
    host: Any = None,
    after_commit: Callable[[int], None] | None = None,
) -> ShardOutcome:
    """Run (or resume) one shard; see the module docstring. ``host`` defaults to the
    process-wide engine host for the batch's model."""
    worker = worker or f"{socket.gethostname()}:{threading.get_ident()}"
    worker = f"{worker}:{uuid.uuid4().hex[:8]}"  # one token per attempt (see claim)
    with log_context(shard_id=shard_id, batch_id=None):
        return _run_shard(shard_id, worker, host, after_commit)


def _run_shard(
    shard_id: int, worker: str, host: Any, after_commit: Callable[[int], None] | None
) -> ShardOutcome:
    loaded = _load(shard_id)
    if loaded is None:
        logger.warning("shard %s is gone", shard_id)
        return ShardOutcome("skipped")
    shard, batch, key = loaded
    bind_log_context(batch_id=batch.id)
    if (
        shard.status in (ShardStatus.DONE, ShardStatus.CLOSED, ShardStatus.STOPPED)
        or batch.status != BatchStatus.IN_PROGRESS
        or past_expiry(batch.expires_at)
    ):
        if shard.status == ShardStatus.DONE and batch.status == BatchStatus.IN_PROGRESS:
            finish_if_last(batch.id)  # a redelivered task of a finished shard
        else:
            finalize_if_idle(batch.id)
        release_next(batch.model)
        return ShardOutcome("skipped")

    if host is None:
        # Before the claim: a model that cannot load here now costs the shard no attempt (it
        # waits for this or another worker), and never turns its requests into shard_failed
        # lines.
        try:
            host = runtime.host(batch.model or "")
        except Exception as exc:
            raise ModelUnavailable(batch.model or "", exc) from exc
    claimed = claim(shard_id, worker)
    if claimed is None:
        finalize_if_idle(batch.id)
        return ShardOutcome("skipped")
    attempt, num_chunks = claimed
    if attempt == 1 and shard.released_at is not None:
        metrics.observe_queue_wait(batch.model or "", shard.released_at)
    max_attempts = get_settings().max_shard_attempts
    if attempt > max_attempts:
        fail_claimed(
            shard_id,
            attempt,
            num_chunks,
            f"The shard holding this request failed {attempt - 1} times "
            f"(max_shard_attempts={max_attempts}); its unfinished requests are reported as "
            "errors",
        )
        return ShardOutcome(BatchStatus.FAILED)
    sto = storage()
    discarded = discard_uncommitted(sto, batch.id, shard.index, num_chunks)
    done_lines = committed_lines(sto, batch.id, shard.index, num_chunks)
    if discarded or done_lines:
        logger.info(
            "shard %s attempt %s resumes: %s lines done, %s uncommitted chunks discarded",
            shard_id,
            attempt,
            len(done_lines),
            discarded,
        )
    run = ShardRun(shard, batch, key, attempt, num_chunks, done_lines, host, after_commit)
    try:
        status = run.run()
    except ShardLost as lost:
        logger.warning("shard %s attempt %s stops: %s", shard_id, attempt, lost)
        return ShardOutcome("lost", run.ran, run.chunk)
    except BaseException:
        # Leave the shard running but mark it abandoned (no heartbeat): a redelivered task
        # may claim it at once, the reclaim sweep re-queues it on its next pass, and a cancel
        # does not wait for it. Either resumes from the last committed checkpoint.
        logger.exception("shard %s attempt %s failed", shard_id, attempt)
        abandon(shard_id, attempt)
        raise
    if not set_shard_status(shard_id, attempt, status):
        return ShardOutcome("lost", run.ran, run.chunk)
    logger.info("shard %s attempt %s %s: %s requests run", shard_id, attempt, status, run.ran)
    if status == ShardStatus.DONE:
        finish_if_last(batch.id)
    else:
        finalize_if_idle(batch.id)
    release_next(batch.model)
    return ShardOutcome(status, run.ran, run.chunk)


@app.task(name=TASK_RUN_SHARD, bind=True)
def run_shard_task(self: Any, shard_id: int) -> None:
    try:
        run_shard(int(shard_id), worker=f"{self.request.hostname}:{threading.get_ident()}")
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
