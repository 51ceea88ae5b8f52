"""A shard's protocol with the database: claim an attempt, commit checkpoint chunks fenced by
the attempt, heartbeat, set the status, and finish the batch when the last shard ends. Every
step is a conditional UPDATE, so a stale attempt (reclaimed, or sealed by a finalize) never
writes over a newer one; each retries through a short database outage (``retrying``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update

from core.batchfile.results import GenerationResult
from core.broker.queue import TASK_FINALIZE
from core.database.lifecycle import BatchStatus, ShardStatus, now, transition
from core.database.results_log import log_chunk
from core.database.sessions import session_scope, updated
from core.database.tables import Batch, Shard
from worker.infra import (
    heartbeat_interval_s,
    live_shards,
    past_expiry,
    retrying,
    send,
    stale_after_s,
    storage,
    unfinished_shards,
)
from worker.shards.checkpoints import (
    ChunkRecord,
    chunk_key,
    write_chunk,
)

logger = logging.getLogger(__name__)


class ShardLost(Exception):
    """Another attempt claimed this shard, or a finalize sealed it: stop without a trace."""


@dataclass
class Pending:
    """Finished results not yet checkpointed, each with its usage."""

    items: list[tuple[ChunkRecord, int, int, int]] = field(default_factory=list)
    # When each ok result finished in the engine (``time.time()``; None where unknown): the
    # lag from there to the chunk's commit is measured (``worker.shards.timings``).
    finished: list[float | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def records(self) -> list[ChunkRecord]:
        return [item[0] for item in self.items]

    @property
    def ok(self) -> int:
        return sum(1 for item in self.items if item[0].ok)

    @property
    def failed(self) -> int:
        return len(self.items) - self.ok

    @property
    def input_tokens(self) -> int:
        return sum(item[1] for item in self.items)

    @property
    def cached_tokens(self) -> int:
        return sum(item[2] for item in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(item[3] for item in self.items)

    def add_ok(
        self,
        line: int,
        record: dict[str, Any],
        result: GenerationResult,
        finished: float | None = None,
    ) -> None:
        self.finished.append(finished)
        self.items.append(
            (
                ChunkRecord(line, True, record),
                result.prompt_tokens,
                result.cached_tokens,
                result.completion_tokens,
            )
        )

    def add_error(self, line: int, record: dict[str, Any]) -> None:
        self.finished.append(None)
        self.items.append((ChunkRecord(line, False, record), 0, 0, 0))

    def take(self, n: int) -> Pending:
        """Split off the first ``n`` results (in the order they finished)."""
        head = Pending(self.items[:n], self.finished[:n])
        del self.items[:n]
        del self.finished[:n]
        return head


def claim(shard_id: int, worker: str, *, force: bool = False) -> tuple[int, int] | None:
    """Claim the shard for a new attempt; (attempt, num_chunks), or None if it is not runnable.

    A ``pending`` shard is claimed; a ``running`` one only if its heartbeat is stale (its
    worker died), if ``worker`` already holds it (a retried claim whose first commit went
    through), or with ``force``. So a duplicate delivery of the task (late acknowledgement,
    a reclaim racing a redelivery) never takes a shard away from a live attempt."""

    def attempt() -> tuple[int, int] | None:
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            if shard is None:
                return None
            status = session.scalar(
                select(Batch.status).where(Batch.id == shard.batch_id).with_for_update(read=True)
            )
            if status != BatchStatus.IN_PROGRESS:
                return None
            claimable = Shard.status == ShardStatus.PENDING
            if force:
                claimable = Shard.status.in_((ShardStatus.PENDING, ShardStatus.RUNNING))
            else:
                cutoff = now() - timedelta(seconds=stale_after_s())
                claimable = claimable | (
                    (Shard.status == ShardStatus.RUNNING)
                    & (
                        Shard.heartbeat_at.is_(None)
                        | (Shard.heartbeat_at < cutoff)
                        | (Shard.worker == worker)
                    )
                )
            row = session.execute(
                update(Shard)
                .where(Shard.id == shard_id, claimable)
                .values(
                    status=ShardStatus.RUNNING,
                    attempts=Shard.attempts + 1,
                    worker=worker,
                    heartbeat_at=now(),
                )
                .returning(Shard.attempts, Shard.num_chunks)
                .execution_options(synchronize_session=False)
            ).first()
            return None if row is None else (row.attempts, row.num_chunks)

    return retrying(attempt, f"claiming shard {shard_id}")


def commit_chunk(shard: Shard, attempt: int, chunk: int, pending: Pending) -> None:
    """Write chunk ``chunk`` and commit it with the live counters, or raise ShardLost.

    The shard row stays locked from the ownership check to the commit, so a newer attempt or
    a finalize sealing the shard waits for this chunk rather than racing it. Retried through
    a database outage; a retry that finds the chunk already committed (the connection died
    after the commit went through) counts it as done."""
    retrying(
        lambda: _commit_chunk_once(shard, attempt, chunk, pending),
        f"committing chunk {chunk} of shard {shard.id}",
    )


def _commit_chunk_once(shard: Shard, attempt: int, chunk: int, pending: Pending) -> None:
    with session_scope() as session:
        row = session.execute(
            select(Shard.attempts, Shard.num_chunks, Shard.status)
            .where(Shard.id == shard.id)
            .with_for_update()
        ).first()
        if (
            row is not None
            and row.attempts == attempt
            and row.status == ShardStatus.RUNNING
            and row.num_chunks == chunk + 1
        ):
            return  # an earlier try committed it; only its acknowledgement was lost
        if (
            row is None
            or row.attempts != attempt
            or row.status != ShardStatus.RUNNING
            or row.num_chunks != chunk
        ):
            raise ShardLost(f"shard {shard.id} is no longer this attempt's ({row})")
        key = chunk_key(shard.batch_id, shard.index, chunk)
        line_ids = write_chunk(storage(), key, pending.records)
        session.execute(
            update(Shard)
            .where(Shard.id == shard.id, Shard.num_chunks == chunk)
            .values(
                num_chunks=chunk + 1,
                done_requests=Shard.done_requests + len(pending),
                heartbeat_at=now(),
            )
            .execution_options(synchronize_session=False)
        )
        session.execute(
            update(Batch)
            .where(Batch.id == shard.batch_id)
            .values(
                request_completed=Batch.request_completed + pending.ok,
                request_failed=Batch.request_failed + pending.failed,
                input_tokens=Batch.input_tokens + pending.input_tokens,
                cached_tokens=Batch.cached_tokens + pending.cached_tokens,
                output_tokens=Batch.output_tokens + pending.output_tokens,
            )
            .execution_options(synchronize_session=False)
        )
        log_chunk(session, shard.batch_id, key, line_ids)  # readable once this commits


def set_shard_status(shard_id: int, attempt: int, status: str) -> bool:
    """End this attempt's shard as ``status``; False if the attempt no longer owns it.
    Idempotent, so a retry after a lost acknowledgement still reports success."""

    def attempt_once() -> bool:
        with session_scope() as session:
            statement = (
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.attempts == attempt,
                    Shard.status.in_((ShardStatus.RUNNING, status)),
                )
                .values(status=status, heartbeat_at=now())
                .execution_options(synchronize_session=False)
            )
            return updated(session, statement) == 1

    return retrying(attempt_once, f"ending shard {shard_id} as {status}")


def hand_back(shard_id: int, attempt: int, *, unrelease: bool = False) -> bool:
    """This attempt stops before the shard's end (its worker drains, or its batch is paused):
    ``running -> pending`` with its committed chunks, and one more hand-back counted, so the
    next claim takes it at once instead of waiting for its heartbeat to go stale. That claim
    raises ``attempts``, fencing this attempt off. ``unrelease``: the shard also leaves the
    release window (a paused batch's; it is released again when the batch resumes). False if
    the attempt no longer owns the shard."""
    extra = {"released_at": None} if unrelease else {}

    def attempt_once() -> bool:
        with session_scope() as session:
            statement = (
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.attempts == attempt,
                    Shard.status == ShardStatus.RUNNING,
                )
                .values(
                    status=ShardStatus.PENDING,
                    worker=None,
                    heartbeat_at=None,
                    handbacks=Shard.handbacks + 1,
                    **extra,
                )
                .execution_options(synchronize_session=False)
            )
            return updated(session, statement) == 1

    return retrying(attempt_once, f"handing back shard {shard_id}")


def handbacks(shard_id: int) -> int:
    """How many of the shard's attempts ended by handing it back (none of them failed)."""

    def attempt() -> int:
        with session_scope() as session:
            return session.scalar(select(Shard.handbacks).where(Shard.id == shard_id)) or 0

    return retrying(attempt, f"reading shard {shard_id}")


def finish_if_last(batch_id: str) -> bool:
    """Move the batch to finalizing if no shard is unfinished; True for the one caller that
    wins. Callers commit their own shard's ``done`` first, so of two shards finishing at once
    at least the later one sees both done, and the conditional transition lets one win.

    If the connection dies while the transition commits, a retry cannot tell whether it won:
    it then sends the finalize anyway (a duplicate finalize is harmless; a lost one is not)."""
    tried = False

    def attempt() -> tuple[bool, bool]:
        nonlocal tried
        retry, tried = tried, True
        with session_scope() as session:
            if unfinished_shards(session, batch_id):
                return False, False
            # A batch whose validation still streams shards waits for its last one (the
            # validation calls this once it has planned it).
            if not session.scalar(select(Batch.validation_done).where(Batch.id == batch_id)):
                return False, False
            if transition(session, batch_id, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING):
                return True, True
            status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
        return False, retry and status == BatchStatus.FINALIZING

    won, resend = retrying(attempt, f"finishing batch {batch_id}")
    if won or resend:
        send(TASK_FINALIZE, batch_id)
    return won


def finalize_if_idle(batch_id: str) -> bool:
    """For a cancelling or expiring batch: enqueue the finalize once no shard is running."""

    def attempt() -> bool:
        with session_scope() as session:
            batch = session.get(Batch, batch_id)
            if batch is None:
                return False
            stopping = batch.status == BatchStatus.CANCELLING or (
                batch.status in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)
                and past_expiry(batch.expires_at)
            )
            return stopping and not live_shards(session, batch_id)

    if not retrying(attempt, f"checking batch {batch_id}"):
        return False
    send(TASK_FINALIZE, batch_id)
    return True


def _heartbeat(shard_id: int, attempt: int) -> bool:
    """Stamp the attempt's heartbeat; False if the attempt no longer owns the shard."""
    with session_scope() as session:
        statement = (
            update(Shard)
            .where(
                Shard.id == shard_id, Shard.attempts == attempt, Shard.status == ShardStatus.RUNNING
            )
            .values(heartbeat_at=now())
            .execution_options(synchronize_session=False)
        )
        return updated(session, statement) == 1


def abandon(shard_id: int, attempt: int) -> None:
    """This attempt failed in-process: clear its heartbeat so the shard is reclaimable now."""

    def attempt_once() -> None:
        with session_scope() as session:
            session.execute(
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.attempts == attempt,
                    Shard.status == ShardStatus.RUNNING,
                )
                .values(heartbeat_at=None)
                .execution_options(synchronize_session=False)
            )

    try:
        retrying(attempt_once, f"abandoning shard {shard_id}", patience_s=10)
    except Exception:
        logger.exception("could not mark shard %s abandoned; the sweep will find it", shard_id)


class Heartbeat:
    """A background thread stamping one attempt's ``heartbeat_at`` every
    ``heartbeat_interval_s``, independent of how long engine steps or storage writes take.

    A database error is logged and the next beat tried (the shard goes stale only if the
    outage outlasts ``shard_stale_after_s``). If the row no longer matches the attempt (it
    was reclaimed, sealed by a finalize, or ended), :attr:`lost` is set and the thread ends.
    """

    def __init__(self, shard_id: int, attempt: int, interval_s: float | None = None):
        self.shard_id = shard_id
        self.attempt = attempt
        self.interval_s = interval_s if interval_s is not None else heartbeat_interval_s()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"batchd-heartbeat-{shard_id}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                owned = _heartbeat(self.shard_id, self.attempt)
            except Exception as exc:
                logger.warning("heartbeat of shard %s failed: %s", self.shard_id, exc)
                continue
            if not owned and not self._stop.is_set():
                self.lost.set()
                return


@dataclass(frozen=True, slots=True)
class BatchState:
    """What a running shard polls of its batch: whether it stops (cancelled, expired, gone),
    whether it is paused, and the tokens its committed results spent (usage.total_tokens)."""

    stopping: bool
    paused: bool = False
    spent: int = 0


def batch_state(batch_id: str) -> BatchState:
    def attempt() -> BatchState:
        with session_scope() as session:
            row = session.execute(
                select(
                    Batch.status,
                    Batch.expires_at,
                    Batch.paused_at,
                    Batch.input_tokens,
                    Batch.output_tokens,
                ).where(Batch.id == batch_id)
            ).first()
        if row is None:
            return BatchState(stopping=True)
        return BatchState(
            stopping=row.status != BatchStatus.IN_PROGRESS or past_expiry(row.expires_at),
            paused=row.paused_at is not None,
            spent=(row.input_tokens or 0) + (row.output_tokens or 0),
        )

    return retrying(attempt, f"reading batch {batch_id}")


def unrelease_paused(shard_id: int) -> bool:
    """Take a pending shard of a paused batch out of the release window (its task came after
    the pause); True if it was. It is released again when the batch resumes."""

    def attempt() -> bool:
        with session_scope() as session:
            paused = select(Batch.id).where(Batch.paused_at.is_not(None))
            statement = (
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.status == ShardStatus.PENDING,
                    Shard.released_at.is_not(None),
                    Shard.batch_id.in_(paused),
                )
                .values(released_at=None)
                .execution_options(synchronize_session=False)
            )
            return updated(session, statement) == 1

    return retrying(attempt, f"unreleasing shard {shard_id}")
