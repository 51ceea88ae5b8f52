"""benchmarks.fleet's arithmetic: the steady rate over the middle of a run, and CPU meters."""

from __future__ import annotations

import os

import pytest

from benchmarks.fleet import Sample, steady_rate
from testkit.bench.cpu import CpuMeter


def test_steady_rate_leaves_out_the_ramp_and_the_tail() -> None:
    # 10 s of start-up with nothing, then 100 lines/s (300 tokens/s), then a slow tail.
    samples = [Sample(0.0, 0, 0), Sample(10.0, 0, 0)]
    samples += [Sample(10.0 + t, 100 * t, 300 * t) for t in range(1, 10)]
    samples += [Sample(29.0, 1000, 3000)]
    assert steady_rate(samples, 1000) == pytest.approx(100.0)
    assert steady_rate(samples, 1000, "tokens") == pytest.approx(300.0)


def test_steady_rate_of_a_run_that_never_moved_is_zero() -> None:
    assert steady_rate([Sample(0.0, 0, 0), Sample(1.0, 0, 0)], 100) == 0.0


def test_cpu_meter_keeps_the_last_reading_of_processes_that_ended() -> None:
    meter = CpuMeter()
    meter.sample({"me": [os.getpid()], "gone": [2**22 + 12345]})  # no such pid
    before = meter.total("me")
    sum(i * i for i in range(300_000))  # some CPU
    meter.sample({"me": [os.getpid()]})
    assert meter.total("me") >= before and meter.total("gone") == 0.0
