"""How many requests to keep in flight at an upstream: found by climbing its throughput.

:class:`ConcurrencyController` looks for the knee of the server's throughput: a slow start from
``initial`` (doubling while it pays), then a step up and a smaller step down in turn, halving on
an overload. A window counts only when the upstream was kept busy. The controller is pure
(given windows, it returns limits), so it drives one worker or the leader of many. Why these
steps: ``docs/upstream.md`` and ``docs/worker.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """What the upstream did over ``seconds``: requests completed, their output tokens and
    summed latency, the mean requests in flight (``busy``), and overloads seen."""

    seconds: float
    completed: int
    output_tokens: int
    latency_s: float
    busy: float
    overloads: int = 0

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_latency(self) -> float:
        return self.latency_s / self.completed if self.completed else 0.0


class ConcurrencyController:
    def __init__(
        self,
        *,
        initial: int = 32,
        maximum: int = 256,
        minimum: int = 1,
        grow_gain: float = 0.10,
        keep_gain: float = 0.03,
        step: float = 1.25,
        down_step: float = 0.9,
        probe_every: int = 4,
        latency_runaway: float = 3.0,
    ) -> None:
        self.maximum = max(1, maximum)
        self.minimum = max(1, min(minimum, self.maximum))
        self.limit = max(self.minimum, min(initial, self.maximum))
        self.grow_gain = grow_gain
        self.keep_gain = keep_gain
        self.step = step
        self.down_step = down_step
        self.probe_every = probe_every
        self.latency_runaway = latency_runaway
        self.slow_start = True
        self.backoffs = 0
        # The best limit measured and its window; the step being tried (from, window before).
        self.best_limit = self.limit
        self.best: Window | None = None
        self._trying: tuple[int, Window] | None = None
        self._steady = 0
        self._up = False  # the direction of the last probe

    def window_is_full(self, window: Window) -> bool:
        """Whether ``window`` measured the limit: the upstream was kept busy enough."""
        return window.completed > 0 and window.busy >= 0.8 * self.limit

    def observe(self, window: Window) -> int:
        """Take one window's measurements; return the limit to use next."""
        if window.overloads:
            return self.overloaded()
        if not self.window_is_full(window):
            return self.limit
        if self._trying is not None:
            before_limit, before = self._trying
            self._trying = None
            if self.limit < before_limit:  # a step down: kept if it costs no throughput
                if window.throughput >= before.throughput * (1 - self.keep_gain):
                    self._record(window)
                    return self.limit
                return self._set(before_limit)
            if self._better(window, before):
                self._record(window)
                if self.slow_start:
                    return self._try(self.limit * 2, window)
                return self.limit
            # The step bought nothing: back to where it came from; slow start ends.
            self.slow_start = False
            self._steady = 0
            return self._set(before_limit)
        if self.best is None or self.limit == self.best_limit:
            self._record(window)
        if self.slow_start:
            return self._try(self.limit * 2, window)
        self._steady += 1
        if self._steady >= self.probe_every:
            self._steady = 0
            self._up = not self._up
            if self._up:
                return self._try(math.ceil(self.limit * self.step), window)
            return self._try(min(self.limit - 1, math.floor(self.limit * self.down_step)), window)
        return self.limit

    def resume(self, limit: int) -> int:
        """Start from ``limit``, one found before (by another worker, or before a restart),
        instead of ``initial``; slow start still tries above it first. Only before this
        controller has judged a window of its own."""
        if self.best is None and self._trying is None:
            self._set(limit)
            self.best_limit = self.limit
        return self.limit

    def idle(self) -> int:
        """The upstream ran out of work: a step being tried can no longer be judged against
        the window before it, so go back to where it came from."""
        if self._trying is not None:
            self._set(self._trying[0])
            self._trying = None
        return self.limit

    def overloaded(self) -> int:
        """The upstream refused work or failed to answer: halve the limit now."""
        self.backoffs += 1
        self.slow_start = False
        self._trying = None
        self._steady = 0
        limit = self._set(self.limit // 2)
        self.best_limit = min(self.best_limit, limit)
        return limit

    # -- internals

    def _better(self, window: Window, before: Window) -> bool:
        gain = self.grow_gain if self.slow_start else self.keep_gain
        if window.throughput < before.throughput * (1 + gain):
            return False
        baseline = (self.best or before).mean_latency
        return not baseline or window.mean_latency <= baseline * self.latency_runaway * (
            window.throughput / max(before.throughput, 1e-9)
        )

    def _record(self, window: Window) -> None:
        self.best, self.best_limit = window, self.limit

    def _try(self, limit: int, window: Window) -> int:
        before = self.limit
        if self._set(limit) == before:  # at the maximum: nothing left to try
            self.slow_start = False
        else:
            self._trying = (before, window)
        return self.limit

    def _set(self, limit: int) -> int:
        self.limit = max(self.minimum, min(int(limit), self.maximum))
        return self.limit
