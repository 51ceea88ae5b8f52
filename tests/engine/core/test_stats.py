"""The engine's metrics (engine/core/stats.py): what one run of known requests records."""

from __future__ import annotations

import pytest

from core.llms.demo import build
from engine import Engine, SamplingParams
from engine.core.stats import Histogram


def test_histogram_buckets_follow_prometheus_le() -> None:
    h = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(value)
    h.observe(0.1, count=2)
    snap = h.snapshot()
    assert snap.counts == [4, 2, 1]
    assert snap.count == 7
    assert snap.cumulative() == [(1.0, 4), (2.0, 6), (float("inf"), 7)]
    assert snap.sum == pytest.approx(0.5 + 1.0 + 1.5 + 2.0 + 3.0 + 0.2)
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))


def test_engine_records_requests_tokens_and_steps() -> None:
    engine = Engine(str(build("llama-tiny")), max_num_seqs=4)
    lengths = [3, 5, 1, 7, 2]
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    h = engine.metrics.histograms()
    assert h["time_to_first_token_seconds"].count == len(lengths)
    assert h["e2e_request_latency_seconds"].count == len(lengths)
    # every token after a request's first is one inter-token interval
    assert h["inter_token_latency_seconds"].count == sum(lengths) - len(lengths)
    stats = engine.stats()
    assert h["step_time_seconds"].count == stats.num_steps
    assert h["tokens_per_step"].sum == stats.total_scheduled_tokens
    assert engine.metrics.finished_by_reason() == {"length": len(lengths)}


def test_metrics_can_be_turned_off() -> None:
    engine = Engine(str(build("llama-tiny")), enable_metrics=False)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.metrics is None
    with pytest.raises(ValueError, match="enable_metrics"):
        Engine(str(build("llama-tiny")), enable_metrics="yes")
