"""What a decode step costs as its running sequences grow, as this engine measured it.

Mostly-decode steps update a moving average of their seconds per sequence count;
:meth:`StepCostCurve.line` fits ``seconds = a + b * seqs`` and :meth:`StepCostCurve.room` tells
the host how many other sequences may share urgent work's steps within ``slowdown`` of their
cost without them. Until the counts span a quarter of ``max_num_seqs``, the answer is every free
slot. Why it follows the hardware: docs/engine.md ("Urgent work").
"""

from __future__ import annotations

import math

DECODE_TOKENS_PER_SEQ = 1.25  # steps with more tokens per sequence carry prefill chunks
SMOOTHING = 0.1  # weight of a new step in its count's moving average
MAX_WEIGHT = 16  # a count seen this often weighs no more in the fit than one seen 16 times


class StepCostCurve:
    """Moving averages of decode-step seconds per running-sequence count (1..max_num_seqs).
    Updated by the engine's loop thread after each step; read by the host on the same
    thread."""

    __slots__ = ("_mean", "_count")

    def __init__(self, max_num_seqs: int) -> None:
        self._mean = [0.0] * (max_num_seqs + 1)
        self._count = [0] * (max_num_seqs + 1)

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """One step's shape and wall time; steps carrying prefill chunks are passed over."""
        if not 0 < num_seqs < len(self._mean) or num_tokens > DECODE_TOKENS_PER_SEQ * num_seqs:
            return
        seen = self._count[num_seqs]
        mean = self._mean[num_seqs]
        self._mean[num_seqs] = seconds if seen == 0 else mean + SMOOTHING * (seconds - mean)
        self._count[num_seqs] = seen + 1

    def line(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds = a + b * seqs``, least squares over the measured counts
        (each weighted by how often it was seen, up to ``MAX_WEIGHT``); None while they span
        less than a quarter of ``max_num_seqs``."""
        pairs = enumerate(zip(self._mean, self._count, strict=True))
        points = [(n, mean, min(seen, MAX_WEIGHT)) for n, (mean, seen) in pairs if seen]
        if not points:
            return None
        span = points[-1][0] - points[0][0]
        if span < max(1, (len(self._mean) - 1) // 4):
            return None
        total = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / total
        mean_t = sum(t * w for _, t, w in points) / total
        var = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        cov = sum(w * (n - mean_n) * (t - mean_t) for n, t, w in points)
        b = cov / var
        return mean_t - b * mean_n, b

    def estimate(self, num_seqs: int) -> float | None:
        """A step's seconds at ``num_seqs``: its own average where measured, else interpolated
        between the nearest measured counts around it, else the fitted line (None while
        :meth:`line` is)."""
        if 0 < num_seqs < len(self._count) and self._count[num_seqs]:
            return self._mean[num_seqs]
        below = next(
            (n for n in range(min(num_seqs, len(self._count)) - 1, 0, -1) if self._count[n]), None
        )
        above = next((n for n in range(num_seqs + 1, len(self._count)) if self._count[n]), None)
        if below is not None and above is not None:
            lo, hi = self._mean[below], self._mean[above]
            return lo + (hi - lo) * (num_seqs - below) / (above - below)
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * num_seqs

    def room(self, base: int, slowdown: float, limit: int) -> int:
        """The most sequences (0..``limit``) that may join ``base`` running ones while a step
        stays within ``slowdown`` times its cost with ``base`` alone (by :meth:`estimate`,
        which follows the measured curve, not only its fitted line: on a CPU the curve
        steepens as sequences grow); ``limit`` when the curve cannot tell or a step's cost
        does not grow with its sequences."""
        fit = self.line()
        if fit is None or fit[1] <= 0 or math.isinf(slowdown):
            return limit
        alone = self.estimate(max(base, 1))
        if alone is None or alone <= 0:
            return limit
        bound = slowdown * alone
        extra = 0
        while extra < limit:
            cost = self.estimate(max(base, 1) + extra + 1)
            if cost is None or cost > bound:
                break
            extra += 1
        return extra
