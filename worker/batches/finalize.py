"""Finalize a batch: merge its shards' checkpoint chunks into the output and error files.

Records merge in input-line order, one shard's chunks open at a time (the shards of a window
cut along prefix groups, which share its range, together). The same path ends every
batch that ran (completed, cancelled, expired); a request that never finished, or was never
validated, gets a ``batch_<code>`` error line, so every input line ends as exactly one line.
One finalize of a batch runs at a time (:func:`sole_finalizer`); the files' rows commit with
the status change. Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from core.batches import ids
from core.batchfile.results import batch_error_line, dumps_line
from core.database.lifecycle import TERMINAL, BatchStatus, ShardStatus, now, transition
from core.database.results_log import chunk_line, final_chunk_key, log_chunk
from core.database.sessions import get_engine, new_session, session_scope
from core.database.tables import Batch, File, Shard
from core.observability import metrics
from core.settings import get_settings
from core.storage.base import Storage
from worker.events import notify
from worker.infra import input_key, live_shards, past_expiry, storage, unfinished_shards
from worker.shards.checkpoints import (
    ChunkRecord,
    chunk_key,
    lines_without_result,
    read_chunk,
)
from worker.shards.release import release_for_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _ShardView:
    index: int
    start_line: int
    start_offset: int
    end_offset: int
    num_chunks: int
    done: bool
    end_line: int = 0


# The end of any input file (``Storage.read_range`` clamps it to the object's size).
_FILE_END = 1 << 62


def target_status(batch: Batch) -> str | None:
    """What a finalize of ``batch`` would end it as, or None if it is not time yet. Expiry
    cuts short only work still to run: a ``finalizing`` batch has none, so it completes."""
    if batch.status in TERMINAL:
        return None
    if batch.status == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if batch.status == BatchStatus.FINALIZING:
        return BatchStatus.COMPLETED
    if past_expiry(batch.expires_at):
        return BatchStatus.EXPIRED
    return None


RESULT_LOST = (
    "The result of this request was lost from storage after it was checkpointed (a missing "
    "chunk of its shard); retry the batch to run it again"
)


def _unfinished(
    sto: Storage, batch_id: str, key: str, shard: _ShardView, code: str, message: str | None = None
) -> Iterator[ChunkRecord]:
    """``batch_<code>`` error records for the shard's lines that have no committed result."""
    for line, custom_id in lines_without_result(sto, key, batch_id, shard, shard.num_chunks):
        yield ChunkRecord(line, False, batch_error_line(custom_id, code, message))


def _unvalidated(
    sto: Storage, batch_id: str, key: str, shards: list[_ShardView], code: str, room: int
) -> Iterator[ChunkRecord]:
    """``batch_<code>`` error records for the lines after the last shard: those a validation
    cut short by a cancel or expiry never reached (none once validation is done: only blank
    lines may follow the last shard). Streamed, in bounded memory, and at most ``room`` of
    them (what ``max_requests_per_batch`` leaves): a line past that could never have been one
    of the batch's requests, so the rest is one line naming the limit, and is not read."""
    last = max(shards, key=lambda s: s.index, default=None)
    rest = _ShardView(
        index=-1,
        start_line=last.end_line if last is not None else 1,
        start_offset=last.end_offset if last is not None else 0,
        end_offset=_FILE_END,
        num_chunks=0,
        done=False,
    )
    for n, rec in enumerate(_unfinished(sto, batch_id, key, rest, code)):
        if n >= room:
            limit = get_settings().max_requests_per_batch
            yield ChunkRecord(rec.line, False, batch_error_line(None, code, (
                f"Line {rec.line} and the lines after it were never validated; a batch holds "
                f"at most {limit} requests (max_requests_per_batch), so they are reported by "
                "this one line"
            )))  # fmt: skip
            return
        yield rec


def merged_records(
    sto: Storage,
    batch_id: str,
    shards: list[_ShardView],
    *,
    key: str | None = None,
    unfinished_code: str | None = None,
) -> Iterator[ChunkRecord]:
    """Every result record of the batch in input-line order (see the module docstring)."""
    emitted = 0
    # Shards cut along prefix groups share their window's range: merged together.
    windows: dict[int, list[_ShardView]] = {}
    for shard in sorted(shards, key=lambda s: (s.start_line, s.index)):
        windows.setdefault(shard.start_offset, []).append(shard)
    for window in windows.values():
        streams: list[Iterator[ChunkRecord]] = []
        for shard in window:
            chunks = [chunk_key(batch_id, shard.index, c) for c in range(shard.num_chunks)]
            present = [k for k in chunks if sto.exists(k)]
            streams.extend(read_chunk(sto, k) for k in present)
            if unfinished_code is not None and not shard.done and key is not None:
                streams.append(_unfinished(sto, batch_id, key, shard, unfinished_code))
            elif len(present) < len(chunks) and key is not None:
                # A committed chunk lost from storage: its lines are reported, never dropped.
                streams.append(_unfinished(sto, batch_id, key, shard, "result_lost", RESULT_LOST))
        for rec in heapq.merge(*streams, key=lambda r: r.line):
            emitted += 1
            yield rec
    if unfinished_code is not None and key is not None:
        room = max(0, get_settings().max_requests_per_batch - emitted)
        yield from _unvalidated(sto, batch_id, key, shards, unfinished_code, room)


class _LazyFile:
    """An output object opened on its first line, so an empty file is never created."""

    def __init__(self, sto: Storage, stack: ExitStack, filename: str):
        self.sto = sto
        self.stack = stack
        self.filename = filename
        self.file_id: str | None = None
        self.key: str | None = None
        self.bytes = 0
        self.lines = 0
        self._out: BinaryIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._out is None:
            self.file_id = ids.file_id()
            self.key = f"files/{self.file_id}"
            self._out = self.stack.enter_context(self.sto.writer(self.key))
        data = dumps_line(record)
        self._out.write(data)
        self.bytes += len(data)
        self.lines += 1


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a finalize read of the batch before it merges: where it goes and what it needs."""

    source: str
    target: str
    key: str
    tenant: str
    model: str | None
    files_created_at: datetime
    files_expire_at: datetime
    validation_done: bool = True


def _plan(batch_id: str) -> _Plan | None:
    """The finalize ``batch_id`` is due, or None if it is not time yet (gone, already over,
    or shards still running that will call back when they stop)."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return None
        target = target_status(batch)
        if target is None:
            return None
        source = batch.status
        if (
            target == BatchStatus.COMPLETED
            and past_expiry(batch.expires_at)
            and unfinished_shards(session, batch_id)
        ):
            target = BatchStatus.EXPIRED  # finalizing with a shard unfinished: never left hanging
        if (
            target != BatchStatus.COMPLETED
            and source != BatchStatus.FINALIZING
            and live_shards(session, batch_id)
        ):
            return None  # the running shards stop within seconds; the last one calls back
        # Output and error files expire output_expires_after seconds after their creation.
        created = now().replace(microsecond=0)
        lifetime_s = batch.output_expires_after_s or get_settings().file_expiry_s
        return _Plan(
            source=source,
            target=target,
            key=input_key(session, batch),
            tenant=batch.tenant,
            model=batch.model,
            files_created_at=created,
            files_expire_at=created + timedelta(seconds=lifetime_s),
            validation_done=bool(batch.validation_done),
        )


def _seal(session: Session, batch_id: str) -> None:
    """Close the batch's unfinished shards: no late checkpoint may land after the merge."""
    session.execute(
        update(Shard)
        .where(
            Shard.batch_id == batch_id,
            Shard.status.not_in((ShardStatus.DONE, ShardStatus.CLOSED)),
        )
        .values(status=ShardStatus.CLOSED)
        .execution_options(synchronize_session=False)
    )


def _shard_views(batch_id: str, seal: bool) -> list[_ShardView]:
    """The batch's shards, first sealed if ``seal``. A validation still streaming creates each
    shard under a lock on the batch row after checking the batch is still running
    (``worker.validation.task``): taking that lock here means the shards read are all it will
    ever create for a batch being cancelled or expired. Shards are sealed before the lock, the
    order a checkpoint commit takes them in, and once more after it (one created meanwhile)."""
    with session_scope() as session:
        if seal:
            _seal(session, batch_id)
        session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
        if seal:
            _seal(session, batch_id)
        return [
            _ShardView(
                s.index,
                s.start_line,
                s.start_offset,
                s.end_offset,
                s.num_chunks,
                s.status == ShardStatus.DONE,
                s.end_line,
            )
            for s in session.scalars(select(Shard).where(Shard.batch_id == batch_id))
        ]


class _FinalChunk:
    """The ``batch_<code>`` lines a finalize writes, as the last chunk of the results log
    (:mod:`core.database.results_log`): stored on the first line, logged with the batch's end."""

    def __init__(self, sto: Storage, stack: ExitStack, batch_id: str):
        self.sto = sto
        self.stack = stack
        self.key = final_chunk_key(batch_id)
        self.line_ids: list[str | None] = []
        self._out: BinaryIO | None = None

    def write(self, rec: ChunkRecord) -> None:
        if self._out is None:
            self._out = self.stack.enter_context(self.sto.writer(self.key))
        self._out.write(chunk_line(rec))
        self.line_ids.append(rec.record.get("id"))


@dataclass(slots=True)
class _Merged:
    out: _LazyFile
    err: _LazyFile
    final: _FinalChunk
    completed: int = 0
    failed: int = 0
    never_ran: int = 0  # batch_<code> lines: requests cut short by a cancel or expiry

    @property
    def written(self) -> list[_LazyFile]:
        return [f for f in (self.out, self.err) if f.file_id is not None]

    @property
    def written_keys(self) -> list[str]:
        keys = [f.key for f in self.written if f.key is not None]
        return keys + ([self.final.key] if self.final.line_ids else [])


# The error code of a request that never ran because its batch stopped, by the batch's status.
_STOPPED_CODES: dict[str, str] = {
    BatchStatus.CANCELLED: "batch_cancelled",
    BatchStatus.EXPIRED: "batch_expired",
}


def _merge(sto: Storage, batch_id: str, shards: list[_ShardView], key: str, target: str) -> _Merged:
    """Write the output and error files of the batch, in input-line order."""
    code = _STOPPED_CODES.get(target)
    with ExitStack() as stack:
        merged = _Merged(
            _LazyFile(sto, stack, f"{batch_id}_output.jsonl"),
            _LazyFile(sto, stack, f"{batch_id}_error.jsonl"),
            _FinalChunk(sto, stack, batch_id),
        )
        for rec in merged_records(sto, batch_id, shards, key=key, unfinished_code=code):
            if rec.ok:
                merged.out.write(rec.record)
                merged.completed += 1
            else:
                merged.err.write(rec.record)
                if rec.record.get("response") is not None:
                    merged.failed += 1
                else:
                    merged.never_ran += 1
                    merged.final.write(rec)
    return merged


def _commit(batch_id: str, plan: _Plan, target: str, merged: _Merged) -> bool:
    """Insert the files' rows and move the batch to ``target`` in one transaction; True if
    this finalize won. A loser's (or a failed commit's) files are deleted."""
    written = merged.written
    session = new_session()
    try:
        for f in written:
            session.add(
                File(
                    id=f.file_id,
                    tenant=plan.tenant,
                    purpose="batch_output",
                    filename=f.filename,
                    bytes=f.bytes,
                    storage_key=f.key,
                    created_at=plan.files_created_at,
                    expires_at=plan.files_expire_at,
                )
            )
        session.flush()
        source, won = plan.source, True
        if target == BatchStatus.COMPLETED and source == BatchStatus.IN_PROGRESS:
            # An expiring batch with every result in completes through finalizing.
            won = transition(session, batch_id, source, BatchStatus.FINALIZING)
            source = BatchStatus.FINALIZING
        counts = {"request_completed": merged.completed, "request_failed": merged.failed}
        if not plan.validation_done:
            # Cut short while validating: every line of the input has its line now.
            counts["request_total"] = merged.completed + merged.failed + merged.never_ran
        won = won and transition(
            session,
            batch_id,
            source,
            target,
            output_file_id=merged.out.file_id,
            error_file_id=merged.err.file_id,
            **counts,
        )
        if won:
            log_chunk(session, batch_id, merged.final.key, merged.final.line_ids)
            session.commit()
        else:
            session.rollback()
    except BaseException:
        session.rollback()
        won = False
        raise
    finally:
        if not won:
            for key in merged.written_keys:
                storage().delete(key)
        session.close()
    return won


def finalize(batch_id: str) -> str | None:
    """Finalize ``batch_id`` if it is ready; return the status it ended in, else None."""
    start = time.monotonic()
    status = _finalize(batch_id)
    if status is not None:
        metrics.FINALIZE_DURATION.labels(outcome=status).observe(time.monotonic() - start)
    return status


_finalizing: set[str] = set()  # SQLite (one process): the batches this process finalizes
_finalizing_lock = threading.Lock()


def _lock_key(batch_id: str) -> int:
    digest = hashlib.sha256(f"batchd.finalize:{batch_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextmanager
def sole_finalizer(batch_id: str) -> Iterator[bool]:
    """Whether this actor is, for the block, the only one finalizing ``batch_id``. On Postgres
    a session advisory lock, held on a connection of its own (idle, not in a transaction,
    while the merge runs) and gone with it if the process dies; on SQLite (one process) a set
    of this process's batches."""
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        with _finalizing_lock:
            sole = batch_id not in _finalizing
            _finalizing.add(batch_id)
        try:
            yield sole
        finally:
            if sole:
                with _finalizing_lock:
                    _finalizing.discard(batch_id)
        return
    key = {"key": _lock_key(batch_id)}
    with engine.connect() as conn:
        sole = bool(conn.execute(text("SELECT pg_try_advisory_lock(:key)"), key).scalar())
        conn.commit()  # the lock is the session's: end the transaction that read it
        try:
            yield sole
        finally:
            if sole:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), key)
                conn.commit()


def _finalize(batch_id: str) -> str | None:
    with sole_finalizer(batch_id) as sole:
        if not sole:
            logger.info(
                "batch %s: another finalize of it is running; leaving it that one", batch_id
            )
            return None
        return _finalize_alone(batch_id)


def _finalize_alone(batch_id: str) -> str | None:
    plan = _plan(batch_id)
    if plan is None:
        return None
    sealed = plan.target != BatchStatus.COMPLETED
    shards = _shard_views(batch_id, sealed)
    if plan.target == BatchStatus.COMPLETED and not (
        plan.validation_done and all(s.done for s in shards)
    ):
        logger.error("batch %s is finalizing with unfinished shards or validation", batch_id)
        return None

    sto = storage()
    merged = _merge(sto, batch_id, shards, plan.key, plan.target)
    target = plan.target
    if (
        target == BatchStatus.EXPIRED
        and plan.source != BatchStatus.VALIDATING
        and plan.validation_done
        and shards
        and not merged.never_ran
    ):
        target = BatchStatus.COMPLETED  # every request has a result: the window cut nothing short
    if not _commit(batch_id, plan, target, merged):
        logger.info("batch %s: another actor finalized it first", batch_id)
        return None
    # The commit recorded the webhook event (if any); enqueue its delivery first thing (the
    # webhook sweep sends it should this process die before).
    notify(batch_id, target)
    # The checkpoint chunks stay: they are the results log, dropped with the output files.
    logger.info(
        "batch %s %s: %s ok, %s error lines", batch_id, target, merged.completed, merged.err.lines
    )
    if sealed:
        # Sealing freed the slots of its released shards that had not started.
        try:
            release_for_model(plan.model)
        except Exception:
            logger.exception(
                "batch %s: could not release the next shards of %s", batch_id, plan.model
            )
    return target
