"""The engine against itself: with and without its metrics, with a share of structured requests."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.engine.run import _agreement, run_engine
from cli.perf.workload import Workload


def _compare_metrics(
    results: dict[str, Any],
    tokens: dict[str, list[list[int]]],
    model_dir: str,
    workload: Workload,
    engine_config: dict[str, Any],
    repeats: int,
) -> None:
    """The engine with its metrics off and on, ``repeats`` rounds in alternating order; the
    ratio of the medians, and the CPU time spent inside the metrics hooks as a share of the
    run (the cost the throughput ratio can show only through the machine's noise)."""
    runs: dict[str, list[dict[str, Any]]] = {"engine_metrics_off": [], "engine_metrics_on": []}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for label in order:
            enabled = label == "engine_metrics_on"
            res = run_engine(
                model_dir, workload, {**engine_config, "enable_metrics": enabled}, label=label
            )
            runs[label].append(res.as_dict())
            tokens[label] = res.token_ids
    for label, rs in runs.items():
        best = sorted(rs, key=lambda x: x["output_tok_per_cpu_s"])[len(rs) // 2]
        results["systems"][label] = best  # the median run
    on, off = runs["engine_metrics_on"], runs["engine_metrics_off"]

    def median(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(x[key] for x in rs)

    ratio = median(on, "output_tok_s") / median(off, "output_tok_s")
    results["ratios"][f"metrics on / off (output tok/s, median of {repeats})"] = ratio
    results["metrics_throughput_ratio"] = ratio
    results["ratios"][f"metrics on / off (output tok per cpu-s, median of {repeats})"] = median(
        on, "output_tok_per_cpu_s"
    ) / median(off, "output_tok_per_cpu_s")
    share = sum(x["metrics_cpu_s"] for x in on) / sum(x["cpu_s"] for x in on)
    results["metrics_cpu_share"] = share
    results["agreement"]["metrics on vs off"] = _agreement(
        tokens["engine_metrics_on"], tokens["engine_metrics_off"]
    )


def _compare_structured(
    results: dict[str, Any],
    model_dir: str,
    workload: Workload,
    engine_config: dict[str, Any],
    share: float,
) -> None:
    """The engine with ``share`` of the requests constrained, against the run without."""
    if not 0.0 < share <= 1.0:
        raise SystemExit(f"--structured-share must be in (0, 1], got {share}")
    base = results["systems"].get("engine")
    if base is None:
        base = run_engine(model_dir, workload, engine_config).as_dict()
        results["systems"]["engine"] = base
    label = f"engine_structured_{share:.0%}"
    r = run_engine(model_dir, workload, engine_config, label=label, structured_share=share)
    s = results["systems"][label] = r.as_dict()
    results["ratios"][f"{label} / engine (output tok/s)"] = (
        s["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else math.inf
    )
    results["ratios"][f"{label} / engine (mean step time)"] = (
        s["engine_stats"]["mean_step_ms"] / base["engine_stats"]["mean_step_ms"]
    )
