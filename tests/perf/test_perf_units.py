"""The pieces of ``batchd bench`` and ``batchd tune`` that need no service: percentiles, the
request-timings buffer, workloads and the spread order."""

from __future__ import annotations

import json
import random
from pathlib import Path

from cli.perf.bench import job_lines, percentile, poisson_jobs, summary
from cli.perf.tune import spread_order
from cli.perf.workload import LengthDist, chat_bodies
from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from worker.shards import timings


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
    make_lines, _ = job_lines("m", input_len="fixed:5", output_len="uniform:2:3")
    jobs = poisson_jobs(
        make_lines, jobs=6, rate=2.0, requests="fixed:4", tenants="a:1,b:1",
        priorities="normal,high", seed=7,
    )  # fmt: skip
    again = poisson_jobs(
        make_lines, jobs=6, rate=2.0, requests="fixed:4", tenants="a:1,b:1",
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
    assert [j.lines for j in jobs] == [j.lines for j in again]  # the lines are seeded too
    ids = [line["custom_id"] for job in jobs for line in job.lines]
    assert len(set(ids)) == len(ids)


def test_job_lines_from_a_file_copy_its_rows_with_the_model_set(tmp_path: Path) -> None:
    path = tmp_path / "real.jsonl"
    rows = [
        {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "old", "messages": [{"role": "user", "content": "hi"}]}},
        {"prompt": "bare completion body", "max_tokens": 3},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_lines, source = job_lines("m", workload=path)
    lines = make_lines(random.Random(3), 20, "job0-")
    assert source == str(path)
    assert [line["custom_id"] for line in lines] == [f"job0-{i}" for i in range(20)]
    urls = {line["url"] for line in lines}
    assert urls == {"/v1/chat/completions", "/v1/completions"}  # both rows drawn in 20
    assert all(line["body"]["model"] == "m" for line in lines)
    assert json.loads(path.read_text().splitlines()[0])["body"]["model"] == "old"


def test_chat_bodies_of_drawn_lengths_are_seeded_and_distinct() -> None:
    words, outs = LengthDist.parse("lognormal:40:0.7"), LengthDist.parse("uniform:4:9")
    bodies = chat_bodies(200, outs, seed=5, words=words, model="m")
    assert bodies == chat_bodies(200, outs, seed=5, words=words, model="m")
    users = [b["messages"][-1]["content"] for b in bodies]
    assert len(set(users)) == len(users)
    counts = [len(u.split()) - 1 for u in users]  # "<i>:" then the words
    assert min(counts) >= 1 and max(counts) <= 160 and 30 <= sum(counts) / len(counts) <= 50
    assert all(4 <= b["max_tokens"] <= 9 and b["model"] == "m" for b in bodies)
    systems = sum(1 for b in bodies if b["messages"][0]["role"] == "system")
    assert 30 <= systems <= 90  # three in ten
    # Without words: ordinary questions, the draw the engine benchmarks' figures were made of.
    plain = chat_bodies(3, 16, seed=0)
    assert [b["messages"][-1]["content"] for b in plain] == [
        "Describe a CPU.",
        "What are common mistakes people make with trains.",
        "Tell a short story about trains.",
    ]
    assert all(b["max_tokens"] == 16 and "model" not in b for b in plain)


def test_spread_order_is_a_permutation_that_mixes_sizes() -> None:
    rng = random.Random(1)
    sizes = [rng.randint(1, 1000) for _ in range(200)]
    order = spread_order(sizes)
    assert sorted(order) == list(range(200))
    mean = sum(sizes) / len(sizes)
    for start in range(0, 180, 10):  # any 20 consecutive picks average close to the mean
        window = [sizes[i] for i in order[start : start + 20]]
        assert abs(sum(window) / 20 - mean) < 0.15 * mean
