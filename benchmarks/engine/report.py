"""The benchmark's figures as a table."""

from __future__ import annotations

import json
import math
from typing import Any


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _print_report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from benchmarks.phases import print_profile

    console = Console(width=max(Console().width, 140))
    w = results["workload"]
    ratio = w["prompt_tokens"] / w["output_tokens"] if w["output_tokens"] else math.inf
    console.print(
        f"[bold]workload[/]: {w.get('num_requests')} requests, {w['prompt_tokens']} prompt + "
        f"{w['output_tokens']} output tokens (prompt/output {ratio:.2f}); "
        f"{json.dumps(w.get('description', {}))}"
    )
    console.print(
        f"[bold]device[/]: {results.get('device')}, dtype {results.get('dtype')}, "
        f"torch threads {results.get('torch_threads')}"
    )
    table = Table(title="throughput (useful tokens)")
    for col in (
        "system",
        "wall s",
        "output tok/s",
        "total tok/s",
        "cpu s",
        "output tok/cpu-s",
        "decoded tokens",
    ):
        table.add_column(col, justify="right" if col != "system" else "left")
    for name, r in results["systems"].items():
        table.add_row(
            name,
            _fmt(r["wall_s"], 2),
            _fmt(r["output_tok_s"]),
            _fmt(r["total_tok_s"]),
            _fmt(r["cpu_s"], 1),
            _fmt(r["output_tok_per_cpu_s"]),
            str(r["generated_tokens"]),
        )
    console.print(table)
    for key, value in results.get("ratios", {}).items():
        console.print(f"{key}: [bold]{value:.3f}x[/]")
    if results.get("metrics_cpu_share") is not None:
        console.print(
            "time inside the engine's metrics hooks: "
            f"[bold]{100 * results['metrics_cpu_share']:.3f}%[/] of the metrics-on runs' CPU time"
        )
    for name, r in results["systems"].items():
        stats = r.get("engine_stats")
        if not stats:
            continue
        console.print(
            f"{name} stats: mean running seqs {stats['mean_running_seqs']:.1f}, mean tokens/step "
            f"{stats['mean_tokens_per_step']:.1f}, steps {stats['num_steps']}, mean step "
            f"{stats['mean_step_ms']:.1f} ms, preemptions "
            f"{stats['num_preemptions']}, prefix-cache hit rate {stats['prefix_cache_hit_rate']:.1%}, "
            f"step time outside forward {stats['outside_forward_frac']:.1%}"
        )
        if stats.get("grammar_masks"):
            console.print(
                f"{name} grammar: {stats['grammar_masks']} token masks, "
                f"{stats['grammar_mask_ms_per_step']:.2f} ms/step computing them beside the "
                f"forward pass, {stats['grammar_wait_ms_per_step']:.2f} ms/step waited for"
            )
    for name, r in results["systems"].items():
        if r.get("phases"):
            print_profile(console, name, r["phases"])
        mm = r.get("matmul")
        if mm:
            console.print(
                f"{name}: a plain {'x'.join(map(str, mm['shape']))} matmul runs at "
                f"{mm['rate_gflop_per_cpu_s']:,.0f} GFLOP per CPU-second here; model work: "
                + ", ".join(
                    f"{phase} {f['gflop_per_cpu_s']:,.0f} ({f['share']:.0%})"
                    for phase, f in mm["phases"].items()
                )
            )
    for key, value in results.get("agreement", {}).items():
        console.print(f"greedy agreement {key}: {value:.0%} of requests identical")
