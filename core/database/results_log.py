"""The results log: a batch's result lines in the order they became durable.

The transaction that commits a shard's checkpoint chunk logs it here: it takes the next
sequence numbers from ``batches.results_logged`` (handed out in commit order, without gaps a
reader could see), a ``result_chunks`` row and one ``result_lines`` row per line. A line is
visible only once durable, and exactly once; once the batch has ended the log holds exactly the
lines of its output and error files. Retention drops it with them (:func:`drop`; docs/core.md)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.orm import Session

from core.database.tables import Batch, ResultChunk, ResultLine
from core.storage.base import Storage

MAX_PAGE = 1000
DEFAULT_PAGE = 100


@dataclass(slots=True)
class ChunkRecord:
    """One result of a checkpoint chunk: its input line, whether it goes to the output file
    (else the error file), and the line itself."""

    line: int
    ok: bool
    record: dict[str, Any]


CURSOR_ROWS_PER_INSERT = 5_000
_INSERT_CURSORS = text(
    "INSERT INTO result_lines (batch_id, line_id, seq) "
    "SELECT :batch_id, c.line_id, c.seq "
    "FROM unnest(CAST(:ids AS varchar[]), CAST(:seqs AS integer[])) AS c(line_id, seq)"
)


def batch_log_prefix(batch_id: str) -> str:
    """Everything a batch's results log keeps in storage lies under this prefix."""
    return f"batches/{batch_id}/"


def final_chunk_key(batch_id: str) -> str:
    """A finalize's own chunk (one per finalize attempt: a loser deletes its own)."""
    return f"{batch_log_prefix(batch_id)}final/{secrets.token_hex(8)}.jsonl"


def write_chunk(storage: Storage, key: str, records: Iterable[ChunkRecord]) -> list[str | None]:
    """Write one chunk atomically, records sorted by line; return their line ids in the order
    written (the order :func:`log_chunk` numbers them)."""
    ids: list[str | None] = []
    with storage.writer(key) as out:
        for rec in sorted(records, key=lambda r: r.line):
            out.write(chunk_line(rec))
            ids.append(rec.record.get("id"))
    return ids


def chunk_line(rec: ChunkRecord) -> bytes:
    """One record of a chunk file: ``{"line", "ok", "record"}`` as one JSON line."""
    data = {"line": rec.line, "ok": rec.ok, "record": rec.record}
    return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


def read_chunk(storage: Storage, key: str) -> Iterator[ChunkRecord]:
    """Stream one chunk's records (in the order written)."""
    with storage.reader(key) as stream:
        for raw in stream:
            if raw.strip():
                obj = json.loads(raw)
                yield ChunkRecord(obj["line"], obj["ok"], obj["record"])


def log_chunk(session: Session, batch_id: str, key: str, line_ids: Sequence[str | None]) -> int:
    """Log a chunk in the caller's transaction (the one that makes it durable); return its
    first sequence number. Every line the service writes has an ``id``; one without (none
    should be) is paged like the others but cannot serve as a cursor."""
    if not line_ids:
        return -1
    n = len(line_ids)
    end = session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(results_logged=Batch.results_logged + n)
        .returning(Batch.results_logged)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    first = end - n
    session.execute(
        insert(ResultChunk).values(batch_id=batch_id, first_seq=first, num_lines=n, storage_key=key)
    )
    # Each slice's rows built as it goes: a finalize's chunk holds every line a cancel cut
    # short. On Postgres a slice is one statement of fixed text with two array parameters
    # (compiled once, no bind per row); elsewhere an executemany.
    postgres = session.get_bind().dialect.name == "postgresql"
    for start in range(0, n, CURSOR_ROWS_PER_INSERT):
        rows = [
            (line_id, first + start + i)
            for i, line_id in enumerate(line_ids[start : start + CURSOR_ROWS_PER_INSERT])
            if isinstance(line_id, str)
        ]
        if not rows:
            continue
        if postgres:
            session.execute(
                _INSERT_CURSORS,
                {"batch_id": batch_id, "ids": [r[0] for r in rows], "seqs": [r[1] for r in rows]},
            )
        else:
            session.execute(
                insert(ResultLine),
                [{"batch_id": batch_id, "line_id": i, "seq": q} for i, q in rows],
            )
    return first


def cursor_seq(session: Session, batch_id: str, line_id: str) -> int | None:
    """The sequence number of the line ``line_id`` in the batch's log, or None."""
    return session.scalar(
        select(ResultLine.seq).where(ResultLine.batch_id == batch_id, ResultLine.line_id == line_id)
    )


@dataclass(frozen=True, slots=True)
class Slice:
    """Lines ``[skip, skip + take)`` of the chunk stored at ``key``."""

    key: str
    skip: int
    take: int


def plan_page(
    chunks: Sequence[tuple[int, int, str]], start: int, limit: int
) -> tuple[list[Slice], bool]:
    """Which parts of which chunks hold lines ``[start, start + limit)``, and whether lines
    after them are logged. ``chunks`` are ``(first_seq, num_lines, key)`` in seq order,
    the first one ending after ``start``."""
    slices: list[Slice] = []
    want = limit
    position = start
    has_more = False
    for first, count, key in chunks:
        end = first + count
        if end <= position:
            continue
        if want == 0:
            has_more = True
            break
        skip = max(0, position - first)
        take = min(count - skip, want)
        slices.append(Slice(key, skip, take))
        want -= take
        position = first + skip + take
        if position < end:
            has_more = True
            break
    return slices, has_more


@dataclass(slots=True)
class Page:
    data: list[dict[str, Any]]
    has_more: bool


def read_page(session: Session, storage: Storage, batch_id: str, *, start: int, limit: int) -> Page:
    """Up to ``limit`` logged lines of the batch from sequence number ``start`` on."""
    rows = session.execute(
        select(ResultChunk.first_seq, ResultChunk.num_lines, ResultChunk.storage_key)
        .where(
            ResultChunk.batch_id == batch_id,
            ResultChunk.first_seq + ResultChunk.num_lines > start,
        )
        .order_by(ResultChunk.first_seq)
        .limit(limit + 1)  # every chunk holds a line: enough to know whether more follow
    ).all()
    slices, has_more = plan_page([(first, n, key) for first, n, key in rows], start, limit)
    data: list[dict[str, Any]] = []
    for part in slices:
        for i, rec in enumerate(read_chunk(storage, part.key)):
            if i >= part.skip + part.take:
                break
            if i >= part.skip:
                data.append(rec.record)
    return Page(data, has_more)


def drop(session: Session, batch_ids: Sequence[str]) -> None:
    """Forget the logs of ``batch_ids`` (the caller deletes their storage prefixes after its
    commit)."""
    if not batch_ids:
        return
    session.execute(delete(ResultLine).where(ResultLine.batch_id.in_(batch_ids)))
    session.execute(delete(ResultChunk).where(ResultChunk.batch_id.in_(batch_ids)))


def drop_for_files(session: Session, file_ids: Iterable[str]) -> list[str]:
    """Forget the logs of the batches whose output or error file is among ``file_ids`` (being
    deleted: by retention or by their owner); return those batches, whose stored chunks
    (``batch_log_prefix``) the caller deletes once this commits. A batch's results go with the
    first of its result files to go: what a client deleted is not served or kept any more."""
    file_ids = list(file_ids)
    if not file_ids:
        return []
    batch_ids = list(
        session.scalars(
            select(Batch.id).where(
                Batch.output_file_id.in_(file_ids) | Batch.error_file_id.in_(file_ids),
                select(ResultChunk.batch_id).where(ResultChunk.batch_id == Batch.id).exists(),
            )
        )
    )
    drop(session, batch_ids)
    return batch_ids
