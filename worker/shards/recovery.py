"""Crash recovery: the reclaim sweep and giving up on a shard.

Beat runs :func:`reclaim_stale_shards`: a running shard whose heartbeat is older than
``shard_stale_after_s`` goes back to ``pending`` and is sent again (it resumes from its last
committed chunk); one past ``max_shard_attempts`` reports its unfinished requests as
``shard_failed`` lines (attempts that handed it back do not count); stuck validates and
finalizes are sent again (:func:`redrive_due`), and so are reclaimed or handed-back shards
whose message was lost. Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from core.batchfile.results import request_error_line
from core.broker.queue import (
    TASK_FINALIZE,
    TASK_RECLAIM,
    TASK_RUN_SHARD,
    TASK_VALIDATE,
    model_queue,
)
from core.database.lifecycle import BatchStatus, ShardStatus, now
from core.database.sessions import session_scope, updated
from core.database.tables import Batch, Shard
from core.observability import metrics
from core.settings import get_settings
from worker.infra import app, input_key, retrying, send, stale_after_s, storage
from worker.shards.checkpoints import discard_uncommitted, lines_without_result
from worker.shards.release import release_next, resend_after_s
from worker.shards.state import (
    Pending,
    ShardLost,
    claim,
    commit_chunk,
    finish_if_last,
    set_shard_status,
)

logger = logging.getLogger(__name__)

SHARD_FAILED = "shard_failed"
RECOVERY_WORKER = "batchd-recovery"


@dataclass
class SweepReport:
    requeued: list[int]
    failed: list[int]
    refinalized: list[str]
    revalidated: list[str] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)


def _shard_failed_line(custom_id: str | None, message: str) -> dict[str, Any]:
    return request_error_line(
        custom_id, status_code=500, message=message, code=SHARD_FAILED, type="server_error"
    )


def fail_claimed(shard_id: int, attempt: int, num_chunks: int, message: str) -> bool:
    """Given up: report every request of the shard that has no committed result as a
    ``shard_failed`` error line, in one chunk committed by ``attempt`` (which the caller
    claimed), mark the shard ``done`` and let the batch finalize. False if the attempt lost
    the shard meanwhile (someone else then owns its fate)."""

    def read() -> tuple[Shard, Batch, str]:
        with session_scope() as session:
            shard = session.get_one(Shard, shard_id)
            batch = session.get_one(Batch, shard.batch_id)
            key = input_key(session, batch)
            session.expunge_all()
        return shard, batch, key

    shard, batch, key = retrying(read, f"reading shard {shard_id}")
    sto = storage()
    discard_uncommitted(sto, batch.id, shard.index, num_chunks)
    pending = Pending()
    for line, custom_id in lines_without_result(sto, key, batch.id, shard, num_chunks):
        pending.add_error(line, _shard_failed_line(custom_id, message))
    try:
        if pending:
            commit_chunk(shard, attempt, num_chunks, pending)
    except ShardLost as lost:
        logger.warning("giving up shard %s: %s", shard_id, lost)
        return False
    if not set_shard_status(shard_id, attempt, ShardStatus.DONE):
        return False
    logger.error(
        "shard %s of batch %s given up after %s attempts: %s requests reported as %s",
        shard_id,
        batch.id,
        attempt - 1,
        len(pending),
        SHARD_FAILED,
    )
    finish_if_last(batch.id)
    release_next(batch.model)
    return True


def fail_shard(shard_id: int, message: str) -> bool:
    """Fence off whatever attempt holds the shard, then :func:`fail_claimed`."""

    claimed = claim(shard_id, RECOVERY_WORKER, force=True)
    if claimed is None:
        return False
    attempt, num_chunks = claimed
    return fail_claimed(shard_id, attempt, num_chunks, message)


def _stale_shards(cutoff: datetime) -> list[tuple[int, int, int, str | None]]:
    with session_scope() as session:
        rows = session.execute(
            select(Shard.id, Shard.attempts, Shard.handbacks, Batch.model)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(
                Shard.status == ShardStatus.RUNNING,
                Batch.status == BatchStatus.IN_PROGRESS,
                Shard.heartbeat_at.is_(None) | (Shard.heartbeat_at < cutoff),
            )
            .order_by(Shard.id)
        ).all()
    return [(r.id, r.attempts, r.handbacks, r.model) for r in rows]


def _requeue(shard_id: int, attempts: int, cutoff: datetime) -> bool:
    """``running -> pending`` if the shard is still the same stale attempt's."""
    with session_scope() as session:
        statement = (
            update(Shard)
            .where(
                Shard.id == shard_id,
                Shard.status == ShardStatus.RUNNING,
                Shard.attempts == attempts,
                Shard.heartbeat_at.is_(None) | (Shard.heartbeat_at < cutoff),
            )
            .values(status=ShardStatus.PENDING, worker=None)
            .execution_options(synchronize_session=False)
        )
        return updated(session, statement) == 1


def _unclaimed_requeues(cutoff: datetime) -> list[tuple[int, str | None]]:
    """(shard id, model) of the reclaimed shards of running batches that no worker has claimed
    since ``cutoff`` (their message was lost), stamped now so the next sweep waits again."""
    with session_scope() as session:
        ids = session.scalars(
            update(Shard)
            .where(
                Shard.status == ShardStatus.PENDING,
                Shard.attempts > 0,  # claimed before: a reclaimed shard (never claimed: release)
                Shard.released_at.is_not(None),
                Shard.updated_at < cutoff,
                Shard.heartbeat_at.is_(None) | (Shard.heartbeat_at < cutoff),
                Shard.batch_id.in_(select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS)),
            )
            .values(updated_at=now())
            .returning(Shard.id)
            .execution_options(synchronize_session=False)
        ).all()
        if not ids:
            return []
        rows = session.execute(
            select(Shard.id, Batch.model)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.id.in_(ids))
            .order_by(Shard.id)
        ).all()
    return [(r.id, r.model) for r in rows]


def redrive_due(age_s: float, bound_s: float, every_s: float) -> bool:
    """Whether a sweep (one every ``every_s``) re-sends the task of a batch stuck for
    ``age_s``: on the first sweep after the age passes ``bound_s``, ``2 * bound_s``, … so a
    slow but live task is not flooded with duplicates while a lost one is sent again."""
    return age_s >= bound_s and (age_s - bound_s) % bound_s < every_s


def _stuck_batches(now: datetime, bound_s: float, every_s: float) -> list[tuple[str, str]]:
    """(batch id, status) of the batches whose validate or finalize is due to be re-sent."""
    cutoff = now - timedelta(seconds=bound_s)
    with session_scope() as session:
        rows = session.execute(
            select(
                Batch.id, Batch.status, Batch.created_at, Batch.finalizing_at, Batch.validated_at
            ).where(
                (
                    (Batch.status == BatchStatus.VALIDATING)
                    & (Batch.created_at < cutoff)
                    & (Batch.expires_at > now)
                )
                | ((Batch.status == BatchStatus.FINALIZING) & (Batch.finalizing_at < cutoff))
                # Validation streams shards into a running batch (worker.validation.task): one
                # that has created none for that long stopped (its worker was killed).
                | (
                    (Batch.status == BatchStatus.IN_PROGRESS)
                    & Batch.validation_done.is_(False)
                    & (Batch.validated_at < cutoff)
                    & (Batch.expires_at > now)
                )
            )
        ).all()
    due = []
    for row in rows:
        since = {
            BatchStatus.VALIDATING: row.created_at,
            BatchStatus.FINALIZING: row.finalizing_at,
        }.get(row.status, row.validated_at)
        if redrive_due((now - since).total_seconds(), bound_s, every_s):
            status = BatchStatus.VALIDATING if row.status == BatchStatus.IN_PROGRESS else row.status
            due.append((row.id, status))
    return due


def reclaim_stale_shards() -> SweepReport:
    """One sweep; see the module docstring."""
    settings = get_settings()
    current = now()
    stale = stale_after_s()
    cutoff = current - timedelta(seconds=stale)
    report = SweepReport([], [], [])
    for shard_id, attempts, handbacks, model in retrying(
        lambda: _stale_shards(cutoff), "finding stale shards"
    ):
        # An attempt that handed the shard back (a drained worker) did not fail.
        if (failed := attempts - handbacks) >= settings.max_shard_attempts:
            message = (
                f"The shard holding this request failed {failed} times (its worker stopped "
                f"responding; max_shard_attempts={settings.max_shard_attempts}); its unfinished "
                "requests are reported as errors"
            )
            try:
                if fail_shard(shard_id, message):
                    report.failed.append(shard_id)
            except Exception:  # one shard's trouble must not keep the sweep from the others
                logger.exception("giving up shard %s failed; the next sweep tries again", shard_id)
            continue
        requeued = retrying(
            functools.partial(_requeue, shard_id, attempts, cutoff),
            f"requeueing shard {shard_id}",
        )
        if requeued:
            metrics.SHARDS_RECLAIMED.labels(model=model or "").inc()
            logger.warning(
                "shard %s (attempt %s) went silent for over %.0fs: re-queued",
                shard_id,
                attempts,
                stale,
            )
            send(TASK_RUN_SHARD, shard_id, queue=model_queue(model or ""))
            report.requeued.append(shard_id)
    # A reclaimed shard whose message was lost holds its release slot: send it again.
    silent_since = current - timedelta(seconds=resend_after_s())
    for shard_id, model in retrying(
        lambda: _unclaimed_requeues(silent_since), "finding lost re-queued shards"
    ):
        logger.warning(
            "shard %s was re-queued but not claimed for over %.0fs: sending it again",
            shard_id,
            resend_after_s(),
        )
        send(TASK_RUN_SHARD, shard_id, queue=model_queue(model or ""))
        report.resent.append(shard_id)
    # A validate or finalize that never ran (its message was lost) or kept failing through an
    # outage: both are idempotent, send it again.
    bound = float(settings.stuck_batch_after_s)
    every = float(settings.reclaim_sweep_interval_s)
    for batch_id, status in retrying(
        lambda: _stuck_batches(current, bound, every), "finding stuck batches"
    ):
        task = TASK_VALIDATE if status == BatchStatus.VALIDATING else TASK_FINALIZE
        logger.warning(
            "batch %s has been %s for over %.0fs: %s sent again", batch_id, status, bound, task
        )
        send(task, batch_id)
        (report.revalidated if status == BatchStatus.VALIDATING else report.refinalized).append(
            batch_id
        )
    return report


@app.task(name=TASK_RECLAIM)
def reclaim_stale_shards_task(**_: Any) -> None:
    report = reclaim_stale_shards()
    if report.requeued or report.failed or report.refinalized or report.resent:
        logger.info(
            "reclaim sweep: %s re-queued, %s sent again, %s given up, %s finalizes re-sent",
            report.requeued,
            report.resent,
            report.failed,
            report.refinalized,
        )
