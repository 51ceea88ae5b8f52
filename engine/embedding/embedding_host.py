"""A thread-safe host for an :class:`~engine.embedding.encoder.EmbeddingEngine`, shared by many
producers.

Producers (the worker's shard threads) submit tokenized requests and get a Future of their
outputs, in input order. The loop thread hands the engine the pending inputs of every producer
at once, up to ``round_tokens`` tokens, so similar lengths share batches. The queue is bounded
(``max_pending``; ``submit`` blocks), ``abort_group`` resolves a group's pending requests as
aborted, and an engine failure fails only that round's requests.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.embedding.encoder import EmbeddingEngine, EmbeddingOutput

logger = logging.getLogger(__name__)


class EmbeddingAborted(RuntimeError):
    """The request was aborted (its group was cancelled) before it ran."""


class EmbeddingHostClosed(RuntimeError):
    """The host is shut down and takes no more work."""


@dataclass(slots=True)
class _Entry:
    inputs: list[list[int]]
    dimensions: int | None
    group: str | None
    future: Future

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.inputs)


class EmbeddingHost:
    def __init__(
        self,
        engine: EmbeddingEngine,
        *,
        max_pending: int = 256,
        round_tokens: int | None = None,
        name: str = "embedding-host",
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        # Enough inputs per round for the length sort to fill several budgets with little
        # padding, yet a round stays short enough for a newly arrived request to run soon.
        self.round_tokens = round_tokens or 8 * engine.max_batch_tokens
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._space = threading.Condition(self._lock)
        self._pending: collections.deque[_Entry] = collections.deque()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.completed = 0
        self.failed = 0
        self.aborted = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self) -> EmbeddingHost:
        self._thread.start()
        return self

    def shutdown(
        self, wait: bool = True, *, abort_pending: bool = False, timeout: float | None = None
    ) -> None:
        with self._lock:
            self._closing = True
            dropped = list(self._pending) if abort_pending else []
            if abort_pending:
                self._pending.clear()
            self._work.notify_all()
            self._space.notify_all()
        for entry in dropped:
            self._abort(entry)
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- producers ------------------------------------------------------------------------------

    def submit(
        self,
        inputs: Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> Future:
        """Queue one request (its inputs as token ids, e.g. from ``engine.token_ids``)."""
        if not inputs:
            raise ValueError("an embedding request needs at least one input")
        entry = _Entry([list(x) for x in inputs], dimensions, group, Future())
        with self._lock:
            deadline_wait = timeout
            while not self._closing and len(self._pending) >= self.max_pending:
                if not self._space.wait(deadline_wait):
                    raise TimeoutError(
                        f"embedding host queue is full ({self.max_pending} pending requests) "
                        f"after waiting {timeout:g}s"
                    )
            if self._closing:
                raise EmbeddingHostClosed("the embedding host is shut down")
            self._pending.append(entry)
            self._work.notify()
        return entry.future

    def abort_group(self, group: str) -> int:
        """Resolve every pending request of ``group`` with :class:`EmbeddingAborted`; a round
        already running finishes (rounds are short). Returns how many were aborted."""
        with self._lock:
            hit = [e for e in self._pending if e.group == group]
            for entry in hit:
                self._pending.remove(entry)
            self._space.notify_all()
        for entry in hit:
            self._abort(entry)
        return len(hit)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- the loop -------------------------------------------------------------------------------

    def _take_round(self) -> list[_Entry] | None:
        with self._lock:
            while not self._pending and not self._closing:
                self._work.wait()
            if not self._pending:
                return None
            taken: list[_Entry] = []
            tokens = 0
            while self._pending and (
                not taken or tokens + self._pending[0].tokens <= self.round_tokens
            ):
                entry = self._pending.popleft()
                tokens += entry.tokens
                taken.append(entry)
            self._space.notify_all()
            return taken

    def _run(self) -> None:
        while self._serve_round():
            pass

    def _serve_round(self) -> bool:
        """Take one round and run it; False when the host is shut down and drained. Its locals
        (the round's entries and outputs) end with it, so an idle loop holds none of them."""
        round_ = self._take_round()
        if round_ is None:
            return False
        self._run_round(round_)
        return True

    def _run_round(self, round_: list[_Entry]) -> None:
        live = [e for e in round_ if e.future.set_running_or_notify_cancel()]
        # One engine call per output size; usually every request asks the model's own size.
        by_size: dict[int | None, list[_Entry]] = {}
        for entry in live:
            by_size.setdefault(entry.dimensions, []).append(entry)
        for dimensions, entries in by_size.items():
            flat = [x for e in entries for x in e.inputs]
            try:
                outputs = self.engine.embed_ids(flat, self.engine.check_dimensions(dimensions))
            except Exception as exc:  # a failed round fails its requests, not the host
                logger.exception("embedding round of %d inputs failed", len(flat))
                for entry in entries:
                    entry.future.set_exception(exc)
                self.failed += len(entries)
                continue
            at = 0
            for entry in entries:
                entry.future.set_result(outputs[at : at + len(entry.inputs)])
                at += len(entry.inputs)
            self.completed += len(entries)

    def _abort(self, entry: _Entry) -> None:
        if entry.future.set_running_or_notify_cancel():
            entry.future.set_exception(EmbeddingAborted("the request was aborted"))
        self.aborted += 1


__all__ = ["EmbeddingAborted", "EmbeddingHost", "EmbeddingHostClosed", "EmbeddingOutput"]
