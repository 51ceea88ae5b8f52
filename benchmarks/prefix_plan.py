"""The prefix plan against file order, on the whole service, side by side in one run.

A job of ``--requests`` chat lines over ``--templates`` few-shot blocks (a long system prompt
per task, ``--template-words`` filler words each), interleaved in file order (line ``i`` uses
block ``i % K``), each with its own short question and a ``max_tokens`` drawn from a mixed
distribution. It runs four ways on the same model workers (the same engine, the same KV
budget, ``--kv-blocks`` blocks of 16 tokens: too few to keep every block cached at once):

* **shared, file order**: validation with ``BATCHD_PREFIX_PLAN=false``;
* **shared, planned**: the default;
* **unique, file order / planned**: the same lengths, but every line's system prompt its own
  (nothing to share): the plan must cost nothing.

All of it with 1 model worker, then 2. Only the control worker is restarted between the runs
(the plan is made at validation); every run's blocks start with a fresh nonce, so no run reads
what the one before left in the prefix cache. Figures per run, from the batch object: output
tokens/s (``usage.output_tokens`` over created → completed) and prefill tokens computed
(``usage.input_tokens`` less ``input_tokens_details.cached_tokens``), and the plan's
``prefix_cache.predicted_shareable_tokens``.

    .venv/bin/python -m benchmarks.prefix_plan --quick      # a few minutes, one round
    .venv/bin/python -m benchmarks.prefix_plan --quick --rounds 3   # medians of 3
    .venv/bin/python -m benchmarks.prefix_plan --json /tmp/prefix_plan.json

Targets (planned / file order, shared job): output tokens/s >= 1.5x, prefill tokens computed
at least 40% fewer; the unique job: output tokens/s >= 0.97x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.perf.workload import CHAT_URL, FILLER_WORDS, request_line
from testkit.service import stack as bs

TPS_TARGET = 1.5
PREFILL_CUT_TARGET = 0.40
UNIQUE_TARGET = 0.97
MAX_TOKENS = (4, 8, 8, 16, 16, 32, 48, 64)  # mixed output lengths


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(n))


def job(args: argparse.Namespace, nonce: str, *, shared: bool) -> list[dict[str, Any]]:
    """The job's lines: K few-shot blocks interleaved in file order (``shared``), or as many
    system prompts as lines, of the same lengths (not ``shared``). Every run draws the same
    lengths and ``max_tokens`` (``--seed``); ``nonce`` starts every system prompt, so that no
    run finds another's blocks in the prefix cache."""
    rng = random.Random(args.seed)
    sizes = [
        rng.randrange(args.template_words * 4 // 5, args.template_words * 6 // 5 + 1)
        for _ in range(args.templates)
    ]
    blocks = [f"{nonce} task {t}. " + _words(rng, size) for t, size in enumerate(sizes)]
    lines = []
    for i in range(args.requests):
        t = i % args.templates
        system = blocks[t] if shared else f"{nonce} line {i}. " + _words(rng, sizes[t])
        body = {
            "model": bs.MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}: " + _words(rng, rng.randrange(4, 12))},
            ],
            "max_tokens": rng.choice(MAX_TOKENS),
            "temperature": 0,
        }
        lines.append(request_line(f"req-{i}", body, CHAT_URL))
    return lines


def run_batch(client: Any, path: Path, poll: float) -> dict[str, Any]:
    batch, _ = bs.upload_and_create(client, path, CHAT_URL)
    created = time.monotonic()
    while batch.status not in bs.TERMINAL:
        time.sleep(poll)
        batch = client.batches.retrieve(batch.id)
    seconds = time.monotonic() - created
    if batch.status != "completed" or batch.request_counts.failed:
        raise RuntimeError(f"batch {batch.id} ended {batch.status}: {batch.request_counts}")
    usage = batch.usage
    extra = batch.model_extra or {}
    plan = extra.get("prefix_cache") or {}
    cached = int(usage.input_tokens_details.cached_tokens)
    return {
        "seconds": seconds,
        "requests": batch.request_counts.completed,
        "output_tokens": int(usage.output_tokens),
        "prompt_tokens": int(usage.input_tokens),
        "cached_tokens": cached,
        "prefill_tokens": int(usage.input_tokens) - cached,
        "predicted_shareable_tokens": int(plan.get("predicted_shareable_tokens", 0)),
        "output_tps": int(usage.output_tokens) / seconds,
    }


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    with path.open("w") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    return path


def measure(args: argparse.Namespace) -> dict[str, Any]:
    spec = str(Path(args.model).resolve()) if args.model else f"demo:{args.model_preset}"
    options = {"num_kv_blocks": args.kv_blocks, "max_num_seqs": args.max_num_seqs}
    work = Path(tempfile.mkdtemp(prefix="batchd-bench-prefix-plan-"))
    results: dict[str, Any] = {"model": spec, "engine_options": options, "runs": {}}
    with bs.Run(work, args.pg_admin_url, args.redis_url, keep=args.keep) as run:
        env = run.env(
            BATCHD_MODELS=json.dumps({bs.MODEL: spec}),
            BATCHD_ENGINE_OPTIONS=json.dumps(options),
            BATCHD_SHARD_MAX_REQUESTS=str(max(1, args.requests // args.shards)),
            BATCHD_WORKER_SHARD_CONCURRENCY=str(args.concurrency),
        )
        stack = run.stack(env)
        stack.start_roles(("api", "beat"))
        client = stack.client(timeout=600)
        controls = 0

        def control(plan: bool) -> None:
            nonlocal controls
            if controls:
                stack.end(f"control{controls}")
            controls += 1
            name = f"control{controls}"
            cmd = bs.celery_command("control", name, work, 2, host="bench")
            stack.start(name, cmd, {**env, "BATCHD_PREFIX_PLAN": "true" if plan else "false"})
            stack.wait_log(name, "ready.", 120)

        runs = 0
        for workers in args.workers:
            for w in range(workers):
                name = f"model-{workers}-{w}"
                cmd = bs.celery_command("model", name, work, args.concurrency, host=f"b{w}")
                stack.start(name, cmd, env)
                stack.wait_log(name, f"model {bs.MODEL} ready", 300)
            control(True)
            warm = job(args, f"warm{workers}", shared=True)[: 2 * args.templates]
            run_batch(client, _write(work / "warm.jsonl", warm), args.poll)
            for round_ in range(args.rounds):
                for shared in (True, False):
                    kind = "shared" if shared else "unique"
                    for plan in (False, True):
                        runs += 1
                        order = "planned" if plan else "file order"
                        print(f"round {round_ + 1}: {kind} {order}, {workers} worker(s) …")
                        control(plan)
                        lines = job(args, f"run{runs}", shared=shared)
                        path = _write(work / f"job-{runs}.jsonl", lines)
                        measured = run_batch(client, path, args.poll)
                        measured["load_1m"] = os.getloadavg()[0]
                        key = f"{kind}/{'plan' if plan else 'file'}/{workers}"
                        results["runs"].setdefault(key, []).append(measured)
            for w in range(workers):
                stack.end(f"model-{workers}-{w}")
    return results


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (the machine's load drifts between runs)."""
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def report(results: dict[str, Any], workers: list[int]) -> bool:
    runs = {key: _median(rounds) for key, rounds in results["runs"].items()}
    results["medians"] = runs
    rounds = len(next(iter(results["runs"].values())))
    print(f"\nmodel {results['model']}, engine {results['engine_options']}, median of {rounds}")
    head = f"{'job':<8}{'workers':>8}{'order':>12}{'s':>8}{'out tok/s':>11}"
    print(head + f"{'prompt':>9}{'cached':>9}{'prefill':>9}{'predicted':>10}")
    for key, r in runs.items():
        kind, order, n = key.split("/")
        print(
            f"{kind:<8}{n:>8}{order:>12}{r['seconds']:>8.1f}{r['output_tps']:>11.1f}"
            f"{r['prompt_tokens']:>9.0f}{r['cached_tokens']:>9.0f}{r['prefill_tokens']:>9.0f}"
            f"{r['predicted_shareable_tokens']:>10.0f}"
        )
    ok = True
    print()
    for n in workers:
        plan, file = runs[f"shared/plan/{n}"], runs[f"shared/file/{n}"]
        tps = plan["output_tps"] / file["output_tps"]
        cut = 1 - plan["prefill_tokens"] / max(1, file["prefill_tokens"])
        uniq = runs[f"unique/plan/{n}"]["output_tps"] / runs[f"unique/file/{n}"]["output_tps"]
        good = tps >= TPS_TARGET and cut >= PREFILL_CUT_TARGET and uniq >= UNIQUE_TARGET
        ok = ok and good
        print(
            f"{n} worker(s): shared job planned/file output tok/s {tps:.2f}x "
            f"(target >= {TPS_TARGET}x), prefill computed {cut:.0%} fewer "
            f"(target >= {PREFILL_CUT_TARGET:.0%}); unique job {uniq:.2f}x "
            f"(target >= {UNIQUE_TARGET}x): {'ok' if good else 'MISSED'}"
        )
        results.setdefault("ratios", {})[str(n)] = {
            "shared_output_tps": tps,
            "shared_prefill_cut": cut,
            "unique_output_tps": uniq,
        }
    return ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller job: a few minutes")
    p.add_argument("--requests", type=int, default=640)
    p.add_argument("--templates", type=int, default=8)
    p.add_argument(
        "--template-words", type=int, default=250, help="mean words per block (~2 tokens each)"
    )
    p.add_argument("--kv-blocks", type=int, default=128, help="the engine's KV blocks (16 tokens)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--shards", type=int, default=4, help="shards per job")
    p.add_argument("--concurrency", type=int, default=2, help="shard threads per model worker")
    p.add_argument("--workers", default="1,2", help="model workers, one run each")
    p.add_argument(
        "--rounds", type=int, default=None, help="runs of each way, medians reported (3; --quick 1)"
    )
    p.add_argument("--model", default=None, help="a model directory or GGUF (else a demo)")
    p.add_argument("--model-preset", default="llama-25m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--pg-admin-url", default=bs.PG_ADMIN_URL)
    p.add_argument("--redis-url", default=bs.REDIS_URL)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 160)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    args.workers = [int(w) for w in str(args.workers).split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = measure(args)
    ok = report(results, args.workers)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
