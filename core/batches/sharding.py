"""Shard planning: split a validated batch file into contiguous line ranges sized by tokens.

Validation feeds :class:`ShardPlanner` one request at a time, in file order. Each
:class:`ShardSpec` is a half-open range of lines and of bytes, one shard's end the next one's
start. A shard closes before a request that would take it over the token limit, or at the
request limit; a request over the token limit alone gets a shard to itself; no shard is empty.
Blank lines, lines that failed validation and resuming after a crash: docs/core.md.

With the prefix plan a window of such shards is cut again along its prefix groups
(:func:`cut_along_groups`): each of those shards names its lines and draws them from the
window's range (``docs/validation.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ShardPlanner", "ShardSpec", "cut_along_groups"]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    index: int
    start_line: int
    end_line: int  # exclusive
    start_offset: int
    end_offset: int  # exclusive
    num_requests: int
    est_tokens: int


class ShardPlanner:
    """Accumulates requests in file order and cuts them into :class:`ShardSpec` ranges."""

    def __init__(
        self,
        max_tokens_per_shard: int,
        max_requests_per_shard: int,
        *,
        first_index: int = 0,
        after_line: int = 0,
        after_offset: int = 0,
    ):
        if max_tokens_per_shard < 1 or max_requests_per_shard < 1:
            raise ValueError("shard limits must be >= 1")
        self.max_tokens = max_tokens_per_shard
        self.max_requests = max_requests_per_shard
        self.first_index = first_index
        self._done: list[ShardSpec] = []
        self._finished = False
        # The open shard.
        self._start_line = 0
        self._start_offset = 0
        self._count = 0
        self._tokens = 0
        # The last request added (a resumed plan starts after the shards already created).
        self._last_line = after_line
        self._last_end = after_offset

    @property
    def open_requests(self) -> int:
        """Requests in the open shard (not yet closed)."""
        return self._count

    @property
    def shards(self) -> list[ShardSpec]:
        """The shards closed so far (the open one is not included)."""
        return list(self._done)

    def _close(self, end_line: int, end_offset: int) -> ShardSpec:
        spec = ShardSpec(
            index=self.first_index + len(self._done),
            start_line=self._start_line,
            end_line=end_line,
            start_offset=self._start_offset,
            end_offset=end_offset,
            num_requests=self._count,
            est_tokens=self._tokens,
        )
        self._done.append(spec)
        self._count = 0
        self._tokens = 0
        return spec

    def add(self, line: int, offset: int, length: int, est_tokens: int) -> ShardSpec | None:
        """Add the request on ``line`` (bytes ``[offset, offset + length)``); returns the shard
        this closed, if any."""
        if self._finished:
            raise RuntimeError("ShardPlanner.add after finish()")
        if line <= self._last_line or offset < self._last_end or length < 1:
            raise ValueError(
                f"requests must be added in file order: line {line} at offset {offset} "
                f"(length {length}) after line {self._last_line} ending at {self._last_end}"
            )
        est_tokens = max(0, int(est_tokens))
        closed = None
        if self._count and (
            self._count >= self.max_requests or self._tokens + est_tokens > self.max_tokens
        ):
            closed = self._close(line, offset)
        if not self._count:
            self._start_line = line
            self._start_offset = offset
        self._count += 1
        self._tokens += est_tokens
        self._last_line = line
        self._last_end = offset + length
        return closed

    def finish(self) -> list[ShardSpec]:
        """Close the open shard and return every shard, in order ([] when nothing was added)."""
        if not self._finished:
            self._finished = True
            if self._count:
                self._close(self._last_line + 1, self._last_end)
        return list(self._done)


def cut_along_groups(
    items: Sequence[tuple[int, tuple[int, ...], int]], max_tokens: int, max_requests: int
) -> list[list[int]]:
    """Cut ``(line, group path, tokens)`` items into shards under the same limits as
    :class:`ShardPlanner`. The items come in run order, sorted on their paths (the prefix
    nodes a line shares, root first), so the lines under any node are together. A group (the
    lines under one node) that fits in the open shard joins it whole, one that fits in a shard
    starts one, and one larger than a shard gets shards of its own, cut the same way along its
    subgroups (in run order when it has none; the last of them may take whole subgroups of
    the same group). Returns each shard's lines, in run order."""
    shards: list[list[int]] = []
    cur: list[int] = []
    tokens = 0

    def close() -> None:
        nonlocal cur, tokens
        if cur:
            shards.append(cur)
        cur, tokens = [], 0

    def add(unit: Sequence[tuple[int, tuple[int, ...], int]], linear: bool = False) -> None:
        nonlocal tokens
        for line, _, t in unit:
            if linear and cur and (len(cur) >= max_requests or tokens + t > max_tokens):
                close()
            cur.append(line)
            tokens += t

    def pack(seq: Sequence[tuple[int, tuple[int, ...], int]], depth: int) -> None:
        start = 0
        while start < len(seq):
            key = seq[start][1][: depth + 1]
            end = start + 1
            while end < len(seq) and seq[end][1][: depth + 1] == key:
                end += 1
            unit = seq[start:end]
            start = end
            size = sum(t for _, _, t in unit)
            if len(cur) + len(unit) <= max_requests and tokens + size <= max_tokens:
                add(unit)
                continue
            close()
            if len(unit) <= max_requests and size <= max_tokens:
                add(unit)
                continue
            # Larger than a shard: along its subgroups, below the prefix all its lines share.
            paths = [p for _, p, _ in unit]
            common = min(len(p) for p in paths)
            first = paths[0]
            for n in range(depth + 1, common):
                if any(p[n] != first[n] for p in paths):
                    common = n
                    break
            if max(len(p) for p in paths) > common:
                pack(unit, common)
            else:
                add(unit, linear=True)
            if depth == 0:
                close()  # its last shard takes no other group (a subgroup's, its siblings)

    pack([(line, path, max(0, t)) for line, path, t in items], 0)
    close()
    return shards
