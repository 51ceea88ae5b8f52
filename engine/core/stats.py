"""Engine metrics cheap enough to leave on: counters and fixed-bucket histograms.

Recorded by the engine's loop thread, read by anyone (a metrics exporter, a benchmark). A
histogram is bucket counts and a sum; a reader copies the lists (atomic under the GIL), and
counts only grow. Nothing here knows Prometheus (the worker exports them). Names follow vLLM's
metrics where the meaning is the same; what each measures: docs/engine.md ("Engine metrics").
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# vLLM's buckets for the same quantities.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
                  1.0, 2.5, 5.0)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Fixed upper bounds (Prometheus' ``le``: a value lands in the first bucket whose bound
    is >= it; the last bucket is +Inf)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase strictly, got {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def snapshot(self) -> HistogramSnapshot:
        counts = list(self.counts)
        return HistogramSnapshot(self.bounds, counts, self.sum, sum(counts))


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket, the last one +Inf (not cumulative)
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, count <= bound)`` pairs ending with ``(inf, count)``."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass(slots=True)
class EngineMetrics:
    time_to_first_token_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    inter_token_latency_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    e2e_request_latency_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    step_time_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    tokens_per_step: Histogram = field(default_factory=lambda: Histogram(TOKENS_PER_STEP_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)
    last_sample_time: float | None = None

    # -- hooks the engine calls (its loop thread only)

    def on_step(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.step_time_s.observe(seconds)
            self.tokens_per_step.observe(num_tokens)

    def on_sample(self, now: float, seqs: Sequence[Any], done: Sequence[Any]) -> None:
        """After a step sampled one token for each of ``seqs`` at ``now``; ``done`` are the
        request outputs it finished."""
        decodes = 0
        ttft = self.time_to_first_token_s
        for seq in seqs:
            if seq.num_output_tokens > 1:
                decodes += 1
            elif seq.index == 0:
                ttft.observe(now - seq.request.metrics.arrival_time)
        if decodes and self.last_sample_time is not None:
            self.inter_token_latency_s.observe(now - self.last_sample_time, decodes)
        self.last_sample_time = now
        for output in done:
            self.e2e_request_latency_s.observe(now - output.metrics.arrival_time)
            reason = output.outputs[0].finish_reason if output.outputs else None
            key = reason or "unknown"
            self.finished[key] = self.finished.get(key, 0) + 1

    # -- readers (any thread)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return {
            "time_to_first_token_seconds": self.time_to_first_token_s.snapshot(),
            "inter_token_latency_seconds": self.inter_token_latency_s.snapshot(),
            "e2e_request_latency_seconds": self.e2e_request_latency_s.snapshot(),
            "step_time_seconds": self.step_time_s.snapshot(),
            "tokens_per_step": self.tokens_per_step.snapshot(),
        }

    def finished_by_reason(self) -> dict[str, int]:
        return dict(self.finished)
