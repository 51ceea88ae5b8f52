"""Shard checkpoint chunks in storage, one JSON record per request in input-line order::

    {"line": 17, "ok": true, "record": {<the output- or error-file line>}}

A chunk counts once the shard's ``num_chunks`` is advanced past it, in the transaction that
advances the live counters; later chunks are an uncommitted attempt's, deleted and redone. The
format and the log of committed chunks: :mod:`core.database.results_log`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from sqlalchemy import select

from core.batchfile.reader import RawLine, custom_id_of, iter_lines
from core.database.results_log import ChunkRecord, read_chunk, write_chunk
from core.database.sessions import session_scope
from core.database.tables import Shard
from core.settings import get_settings
from core.storage.base import ObjectNotFound, Storage
from worker.shards.prepared import ShardLinesLost, read_lines

logger = logging.getLogger(__name__)

__all__ = [
    "ChunkRecord",
    "batch_prefix",
    "chunk_key",
    "committed_chunks",
    "committed_lines",
    "discard_uncommitted",
    "lines_without_result",
    "own_lines",
    "shard_lines",
    "read_chunk",
    "write_chunk",
]


def batch_prefix(batch_id: str) -> str:
    return f"batches/{batch_id}/shards"


def shard_prefix(batch_id: str, shard_index: int) -> str:
    return f"{batch_prefix(batch_id)}/{shard_index:05d}"


def chunk_key(batch_id: str, shard_index: int, chunk: int) -> str:
    return f"{shard_prefix(batch_id, shard_index)}/{chunk:06d}.jsonl"


def _chunk_number(key: str) -> int | None:
    name = key.rsplit("/", 1)[-1]
    stem = name.removesuffix(".jsonl")
    return int(stem) if stem != name and stem.isdigit() else None


def committed_chunks(batch_id: str, shard_index: int, num_chunks: int) -> list[str]:
    return [chunk_key(batch_id, shard_index, i) for i in range(num_chunks)]


def committed_lines(storage: Storage, batch_id: str, shard_index: int, num_chunks: int) -> set[int]:
    """Input lines whose results the shard's committed chunks already hold. A committed chunk
    missing from storage (lost by the store, deleted by hand) holds nothing: its lines count
    as not done, so a resumed attempt runs them again and a finalize reports them, instead of
    the shard failing at every attempt and wedging its batch."""
    done: set[int] = set()
    for key in committed_chunks(batch_id, shard_index, num_chunks):
        try:
            done.update(rec.line for rec in read_chunk(storage, key))
        except ObjectNotFound:
            logger.error("committed checkpoint chunk %s is missing from storage", key)
    return done


def discard_uncommitted(storage: Storage, batch_id: str, shard_index: int, num_chunks: int) -> int:
    """Delete chunks written by an attempt that never committed them; return how many."""
    removed = 0
    for key in storage.list(shard_prefix(batch_id, shard_index)):
        number = _chunk_number(key)
        if number is None or number >= num_chunks:
            storage.delete(key)
            removed += 1
    return removed


class ShardSpan(Protocol):
    """What is read of a shard: its index and its range of the input file (a ``Shard`` row,
    or finalize's view of one)."""

    @property
    def index(self) -> int: ...
    @property
    def start_line(self) -> int: ...
    @property
    def start_offset(self) -> int: ...
    @property
    def end_offset(self) -> int: ...


def own_lines(
    storage: Storage, batch_id: str, shard: ShardSpan, input_key: str
) -> list[int] | None:
    """The lines of a shard cut along prefix groups, in run order (``worker.shards.prepared``);
    None for a shard that holds every line of its range. A shard whose list is lost while
    other shards share its range holds the lines of the range that their lists do not name
    (in file order); were one of theirs lost too, the lines could not be told apart, and
    running or reporting the whole range would repeat theirs: :class:`ShardLinesLost`."""
    if shard.index < 0:
        return None
    lines = read_lines(storage, batch_id, shard.index)
    if lines is not None:
        return lines
    with session_scope() as session:
        siblings = session.scalars(
            select(Shard.index).where(
                Shard.batch_id == batch_id,
                Shard.start_offset == shard.start_offset,
                Shard.index != shard.index,
            )
        ).all()
    if not siblings:
        return None
    theirs: set[int] = set()
    for index in siblings:
        named = read_lines(storage, batch_id, index)
        if named is None:
            raise ShardLinesLost(
                f"batch {batch_id} shard {shard.index}: its line list and shard {index}'s are "
                "missing"
            )
        theirs.update(named)
    logger.error(
        "batch %s shard %s: its line list is missing; it holds the lines of its range the other "
        "shards of the range do not name",
        batch_id,
        shard.index,
    )
    return [
        raw.line for raw in shard_lines(storage, input_key, shard, None) if raw.line not in theirs
    ]


def shard_lines(
    storage: Storage, input_key: str, shard: ShardSpan, own: list[int] | None
) -> Iterator[RawLine]:
    """The shard's input lines in file order: its range, or of its range the lines ``own``
    names (see :func:`own_lines`)."""
    chunks = storage.read_range(input_key, shard.start_offset, shard.end_offset)
    lines = iter_lines(
        chunks,
        max_line_bytes=get_settings().max_line_bytes,
        first_line=shard.start_line,
        base_offset=shard.start_offset,
    )
    if own is None:
        yield from lines
        return
    wanted = set(own)
    for raw in lines:
        if raw.line in wanted:
            yield raw


def lines_without_result(
    storage: Storage,
    input_key: str,
    batch_id: str,
    shard: ShardSpan,
    num_chunks: int,
) -> Iterator[tuple[int, str | None]]:
    """(line, custom_id) of the shard's input lines that its committed chunks hold no result
    for: what a cancel, an expiry or a given-up shard must still report."""
    done = committed_lines(storage, batch_id, shard.index, num_chunks)
    own = own_lines(storage, batch_id, shard, input_key)
    for raw in shard_lines(storage, input_key, shard, own):
        if raw.line in done:
            continue
        yield raw.line, custom_id_of(raw)
