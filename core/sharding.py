"""Shard planning: split a validated batch file into contiguous line ranges sized by tokens.

The validate task feeds the planner one valid request at a time, in file order::

    planner = ShardPlanner(settings.shard_max_tokens, settings.shard_max_requests)
    validate_file(..., on_request=lambda r: planner.add(r.line, r.offset, r.length,
                                                        count_tokens(r)))
    specs = planner.finish()   # one ``shards`` row per spec

Each :class:`ShardSpec` is a half-open range of lines ``[start_line, end_line)`` and of bytes
``[start_offset, end_offset)``. Shards are contiguous: one shard's ``end_line``/``end_offset``
is the next one's ``start_line``/``start_offset``. The first shard starts at the first request;
the last ends right after the last request. Blank lines between two requests belong to the
earlier shard; re-reading them is harmless (:func:`core.batchfile.reader.iter_lines` skips them).

A shard is closed before a request that would push it over ``max_tokens_per_shard`` estimated
tokens, or when it holds ``max_requests_per_shard`` requests. A request larger than the token
limit on its own gets a shard to itself; no shard is ever empty.

Streamed validation (``worker.tasks``) creates each shard as soon as :meth:`ShardPlanner.add`
returns it closed, and adds a line that failed validation after the file's head as a request
of 0 tokens: it stays inside its shard's line range, where the shard's first checkpoint chunk
holds its error line. A validation that resumes after a crash plans on from its last durable
shard: ``first_index`` is that shard's index + 1, ``after_line`` its ``end_line - 1`` and
``after_offset`` its ``end_offset`` (the planner then refuses anything before them).
"""

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
