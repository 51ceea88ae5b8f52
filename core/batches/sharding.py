"""Shard planning: split a validated batch file into contiguous line ranges sized by tokens.

Validation feeds :class:`ShardPlanner` one request at a time, in file order. Each
:class:`ShardSpec` is a half-open range of lines and of bytes, one shard's end the next one's
start. A shard closes before a request that would take it over the token limit, or at the
request limit; a request over the token limit alone gets a shard to itself; no shard is empty.
Blank lines, lines that failed validation and resuming after a crash: docs/core.md."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardPlanner", "ShardSpec"]


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
