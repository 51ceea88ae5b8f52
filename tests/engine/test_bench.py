"""The benchmark runs end to end on a tiny model and reports comparable figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine as bench
from core.llms.demo import build


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build("llama-tiny")


def test_bench_runs_every_system_on_the_same_work(
    model_dir: Path, tmp_path: Path, engine_test_device: str
) -> None:
    out = tmp_path / "bench.json"
    results = bench.main(
        [
            "--model",
            str(model_dir),
            "--num-requests",
            "6",
            "--input-len",
            "uniform:4:24",
            "--output-len",
            "uniform:2:10",
            "--static-batch-size",
            "4",
            "--engine-arg",
            "max_num_seqs=4",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["systems"].keys() == {"engine", "static", "generate_batch"}
    work = data["workload"]
    assert work["num_requests"] == 6
    assert work["description"]["workload"] == "generation-heavy"  # the default preset
    for name, r in data["systems"].items():
        assert r["prompt_tokens"] == work["prompt_tokens"], name
        assert r["output_tokens"] == work["output_tokens"], name
        assert r["wall_s"] > 0 and r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        assert r["cpu_s"] > 0 and r["output_tok_per_cpu_s"] > 0
    # Static batches decode every row to the batch's longest budget.
    assert data["systems"]["static"]["generated_tokens"] >= work["output_tokens"]
    stats = data["systems"]["engine"]["engine_stats"]
    assert stats["num_steps"] > 0 and 0 < stats["mean_running_seqs"] <= 4
    assert stats["mean_tokens_per_step"] >= 1 and 0.0 <= stats["outside_forward_frac"] < 1.0
    assert {"engine / static (output tok/s)", "engine / generate_batch (output tok/s)"} <= set(
        data["ratios"]
    )
    assert all(v > 0 for v in data["ratios"].values())
    # Every system on the engine's device and dtype.
    device = data["device"]
    assert device.startswith(engine_test_device) and data["dtype"] == "float32"
    assert {r["device"] for r in data["systems"].values()} == {device}
    assert {r["dtype"] for r in data["systems"].values()} == {"float32"}
    assert data["systems"]["generate_batch"]["attn_implementation"] in (
        "sdpa",
        "flash_attention_2",
        "flash_attention_3",
    )
    # Where the time goes, for both continuous-batching systems: the phases cover the run,
    # every prompt and output token is counted once, the forward is part of each step.
    for name in ("engine", "generate_batch"):
        prof = data["systems"][name]["phases"]
        assert set(prof["phases"]) == {"prefill", "decode", "tail"}, name
        whole = prof["all"]
        assert whole["steps"] == sum(p["steps"] for p in prof["phases"].values()) > 0
        assert whole["prefill_tokens"] == work["prompt_tokens"], name
        # Every output token but the first (sampled by its prefill step) is a decode token.
        assert whole["decode_tokens"] == work["output_tokens"] - work["num_requests"], name
        assert 0 < whole["forward_s"] <= whole["time_s"] <= data["systems"][name]["wall_s"]
        assert 0 < whole["cpu_s"] <= data["systems"][name]["cpu_s"] * 1.05, name
        assert whole["forward_prefill_tok_s"] >= whole["prefill_tok_s"] > 0
        assert prof["phases"]["prefill"]["steps"] > 0 and prof["phases"]["decode"]["steps"] > 0
    assert data["systems"]["engine"]["phases"]["num_steps"] == stats["num_steps"]
    # Greedy decoding on identical prompts: the engine agrees with transformers token for token.
    assert data["agreement"]["engine vs generate_batch"] == 1.0
    assert results["workload"] == work


def test_bench_workload_presets() -> None:
    args = bench.build_parser().parse_args([])
    assert args.workload == bench.DEFAULT_WORKLOAD == "generation-heavy"
    totals = {}
    for name, (n, inp, out) in bench.WORKLOADS.items():
        assert n >= (32 if name == "long-context" else 64), name
        w = bench.synthetic_workload(
            num_requests=n,
            input_len=bench.LengthDist.parse(inp),
            output_len=bench.LengthDist.parse(out),
            shared_prefix_frac=0.0,
            vocab=range(10, 500),
            max_model_len=4096,
            seed=0,
        )
        assert len(set(w.max_tokens)) > n // 4 and len({len(p) for p in w.prompts}) > n // 4
        totals[name] = w.prompt_tokens / w.output_tokens
    assert totals["generation-heavy"] < 1.5 and totals["prompt-heavy"] > 3
    assert totals["long-context"] > 10
    long = bench.WORKLOADS["long-context"]
    assert long[1:] == ("uniform:1000:2000", "lognormal:96:0.6")


def test_bench_compares_prefix_caching(model_dir: Path) -> None:
    results = bench.main(
        [
            "--model",
            str(model_dir),
            "--num-requests",
            "4",
            "--input-len",
            "fixed:64",
            "--output-len",
            "fixed:2",
            "--compare-prefix-caching",
        ]
    )
    on = results["systems"]["engine_prefix_cache"]["engine_stats"]
    off = results["systems"]["engine_no_prefix_cache"]["engine_stats"]
    assert off["prefix_cache_hit_rate"] == 0.0
    assert on["prefix_cache_hit_rate"] > 0.5  # 80% of each prompt is shared by default
    assert results["prefix_caching_speedup"] > 0
    assert results["agreement"]["prefix cache on vs off"] == 1.0


def test_length_distributions_and_jsonl_workload(tmp_path: Path, model_dir: Path) -> None:
    import random

    from transformers import AutoTokenizer

    rng = random.Random(0)
    assert bench.LengthDist.parse("fixed:7").sample(rng) == 7
    assert all(3 <= bench.LengthDist.parse("uniform:3:9").sample(rng) <= 9 for _ in range(50))
    samples = [bench.LengthDist.parse("lognormal:20:1.0").sample(rng) for _ in range(500)]
    assert all(1 <= s <= 80 for s in samples)
    with pytest.raises(ValueError, match="fixed:N"):
        bench.LengthDist.parse("gauss:3")

    path = tmp_path / "batch.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {
                    "custom_id": "a",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 5,
                    },
                },
                {"prompt": "the quick brown fox", "max_tokens": 3},
                {  # the service's rule: max_completion_tokens wins over max_tokens
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "max_completion_tokens": 7,
                },
            ]
        )
        + "\n"
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = bench.jsonl_workload(path, tok, max_model_len=1024, default_max_tokens=16, limit=None)
    assert work.max_tokens == [5, 3, 7]
    assert work.prompts[1] == tok.encode("the quick brown fox")


def test_phase_summary_classes_steps_and_finds_the_tail() -> None:
    from benchmarks.phases import Step, summarise

    steps = [
        Step(60, 0, 4, step_s=1.0, forward_s=0.8),  # prefill
        Step(10, 30, 40, step_s=1.0, forward_s=0.5),  # mostly decode
        Step(30, 4, 9, step_s=2.0, forward_s=1.0),  # mostly prefill, busy
        Step(0, 8, 8, step_s=0.5, forward_s=0.25),  # decode, 8 >= 32 / 4: not the tail yet
        Step(0, 7, 7, step_s=0.5, forward_s=0.25),  # the tail: fewer than 8 run from here on
        Step(5, 2, 2, step_s=0.5, forward_s=0.25),
    ]
    prof = summarise(steps, max_num_seqs=32)
    ph = prof["phases"]
    assert (ph["prefill"]["steps"], ph["decode"]["steps"], ph["tail"]["steps"]) == (2, 2, 2)
    assert ph["prefill"]["time_s"] == 3.0 and ph["prefill"]["prefill_tokens"] == 90
    assert ph["prefill"]["prefill_tok_s"] == 30.0 and ph["prefill"]["forward_prefill_tok_s"] == 50.0
    assert ph["decode"]["decode_tokens"] == 38 and ph["tail"]["mean_running"] == 4.5
    assert prof["all"]["time_s"] == 5.5 and abs(ph["tail"]["time_share"] - 1 / 5.5) < 1e-9
    assert prof["all"]["outside_forward_frac"] == 1 - 3.05 / 5.5


def test_bench_compares_metrics_and_times_their_hooks(model_dir: Path) -> None:
    results = bench.main(
        [
            "--model",
            str(model_dir),
            "--num-requests",
            "4",
            "--input-len",
            "fixed:8",
            "--output-len",
            "fixed:6",
            "--compare-metrics",
            "--repeats",
            "2",
        ]
    )
    on = results["systems"]["engine_metrics_on"]
    off = results["systems"]["engine_metrics_off"]
    assert on["metrics_cpu_s"] > 0  # the hooks ran and were timed
    assert off["metrics_cpu_s"] is None  # no metrics, no hooks
    assert 0 < results["metrics_cpu_share"] < 1
    assert results["metrics_throughput_ratio"] > 0
    assert results["agreement"]["metrics on vs off"] == 1.0


def test_versions_compares_two_trees_on_the_same_requests(model_dir: Path) -> None:
    from benchmarks import versions

    job = {
        "model": str(model_dir),
        "config": {"max_num_seqs": 4},
        "prompts": [[5, 6, 7], [8, 9, 10, 11]],
        "max_tokens": [3, 5],
    }
    report = versions.compare(versions.ROOT, versions.ROOT, job, rounds=1, log=lambda _: None)
    assert report["same_tokens"]
    assert [r["output_tokens"] for r in report["runs"]["head"]] == [8]
    assert report["ratio_cpu"] > 0 and report["ratio_wall"] > 0
