"""The pieces of ``batchd bench`` and ``batchd tune`` that need no service: percentiles, the
request-timings buffer, workloads and the spread order."""

from __future__ import annotations

import random

from cli.perf.bench import Shapes, percentile, poisson_jobs, summary
from cli.perf.tune import spread_order
from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from worker import timings


def test_summary_percentiles_interpolate_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    s = summary(values)
    assert s["n"] == 100 and s["mean"] == 50.5 and s["max"] == 100.0
    assert s["p50"] == 50.5
    assert abs(s["p90"] - 90.1) < 1e-9 and abs(s["p99"] - 99.01) < 1e-9
    assert percentile([3.0], 0.99) == 3.0
    assert summary([])["p50"] is None


def test_timings_keeps_finished_requests_per_batch() -> None:
    def output(rid: str, n: int) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=[1, 2, 3],
            outputs=[CompletionOutput(index=0, text="", token_ids=list(range(n)))],
            finished=True,
            metrics=RequestMetrics(arrival_time=10.0, first_token_time=10.5, finished_time=12.0),
        )

    timings.record("batch_perf_a", 0, "a-1", 9.0, output("x", 4))
    timings.record("batch_perf_b", 1, "b-1", 9.5, output("y", 2))
    rows = timings.records(["batch_perf_a"])
    assert rows == [
        {
            "batch_id": "batch_perf_a",
            "shard": 0,
            "custom_id": "a-1",
            "submitted": 9.0,
            "admitted": 10.0,
            "first_token": 10.5,
            "finished": 12.0,
            "prompt_tokens": 3,
            "cached_tokens": 0,
            "output_tokens": 4,
        }
    ]
    assert {r["custom_id"] for r in timings.records()} >= {"a-1", "b-1"}


def test_poisson_jobs_are_seeded_and_shaped() -> None:
    shapes = Shapes("m", input_len="fixed:5", output_len="uniform:2:3")
    jobs = poisson_jobs(
        shapes, jobs=6, rate=2.0, requests="fixed:4", tenants="a:1,b:1",
        priorities="normal,high", seed=7,
    )  # fmt: skip
    again = poisson_jobs(
        shapes, jobs=6, rate=2.0, requests="fixed:4", tenants="a:1,b:1",
        priorities="normal,high", seed=7,
    )  # fmt: skip
    assert [(j.at, j.tenant, j.priority) for j in jobs] == [
        (j.at, j.tenant, j.priority) for j in again
    ]
    assert jobs[0].at == 0 and all(a.at < b.at for a, b in zip(jobs, jobs[1:], strict=False))
    for job in jobs:
        assert len(job.lines) == 4 and job.endpoint == "/v1/completions"
        for line in job.lines:
            assert len(line["body"]["prompt"]) == 5 and 2 <= line["body"]["max_tokens"] <= 3
            assert line["body"]["ignore_eos"] is True
    ids = [line["custom_id"] for job in jobs for line in job.lines]
    assert len(set(ids)) == len(ids)


def test_spread_order_is_a_permutation_that_mixes_sizes() -> None:
    rng = random.Random(1)
    sizes = [rng.randint(1, 1000) for _ in range(200)]
    order = spread_order(sizes)
    assert sorted(order) == list(range(200))
    mean = sum(sizes) / len(sizes)
    for start in range(0, 180, 10):  # any 20 consecutive picks average close to the mean
        window = [sizes[i] for i in order[start : start + 20]]
        assert abs(sum(window) / 20 - mean) < 0.15 * mean
