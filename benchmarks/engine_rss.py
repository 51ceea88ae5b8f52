"""Process memory over a long run: many requests through one EngineHost, RSS sampled as they go.

    python -m benchmarks.engine_rss --requests 100000
    python -m benchmarks.engine_rss --requests 20000 --sample-every 1000 --json rss.json

The service is meant to be left running for months, so everything the engine and its host keep
for a request must go when the request does. This runs ``--requests`` requests through one
:class:`engine.host.host.EngineHost` over a tiny demo model (``llama-tiny``, so the run measures the
engine's bookkeeping, not the model): distinct random prompts of ``--prompt-len`` tokens (by
default 17-48, so every prompt fills a KV block and has a prefix bucket of its own) and short
greedy outputs (``--max-tokens``), fed by one producer thread per tenant (``--tenants``) in
batches of ``--batch-size`` requests (each batch a host group that ends), with a share of
``n > 1`` requests (``--n-share``) and of requests aborted right after they are submitted
(``--abort-share``). Nothing of a finished request is kept by the benchmark itself: futures
are dropped, completions are counted by callbacks.

Every ``--sample-every`` finished requests the process RSS (``VmRSS`` in /proc/self/status) is
recorded. The report prints the curve, and the growth from the end of the warm-up
(``--warmup``, a fraction of the requests, default 0.1) to the end, in MB and per 10,000
requests. A bounded engine gives a flat curve after the warm-up, give or take the allocator's
noise; a leak gives a slope.

The KV pool is fixed-size, but its pages become resident as blocks are first written, and the
block manager hands out the least recently freed block, so a large pool is touched a little
more with every request until all of it has been used. The default pool (``--kv-blocks``
1024, 8 MiB on this model) is fully touched within the warm-up, so what grows after it is not
the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli.perf.service import memory_kb


def rss_mb() -> float:
    """The process's resident set size in MB (``VmRSS`` of /proc/self/status)."""
    memory = memory_kb(os.getpid())
    if memory is None:
        raise RuntimeError("no VmRSS in /proc/self/status")
    return memory[0] / 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_rss", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=100_000, help="requests in all (100,000)")
    p.add_argument(
        "--sample-every",
        type=int,
        default=None,
        help="finished requests between two RSS samples (default: requests / 50)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.1,
        help="fraction of the requests before the growth is measured (default 0.1)",
    )
    p.add_argument("--model", help="model directory (default: the demo llama-tiny, built on use)")
    p.add_argument("--prompt-len", default="17:48", help="prompt tokens, LOW:HIGH (17:48)")
    p.add_argument("--max-tokens", default="1:4", help="output tokens, LOW:HIGH (1:4)")
    p.add_argument("--tenants", type=int, default=2, help="producer threads, one tenant each")
    p.add_argument("--batch-size", type=int, default=500, help="requests per host group")
    p.add_argument("--n-share", type=float, default=0.02, help="share of n=4 requests")
    p.add_argument("--abort-share", type=float, default=0.01, help="share aborted at once")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV pool size (1024 blocks)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine's (device default)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine more threads make every "
        "step wait at OpenMP barriers)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the curve and the figures to this file")
    return p


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import Engine, SamplingParams
    from engine.host.host import EngineHost

    torch.set_num_threads(args.threads)
    if args.model:
        model_dir = str(args.model)
    else:
        from core.llms.demo import build

        model_dir = str(build("llama-tiny"))
    config: dict[str, Any] = {"num_kv_blocks": args.kv_blocks}
    if args.max_num_seqs:
        config["max_num_seqs"] = args.max_num_seqs
    engine = Engine(model_dir, **config)
    vocab = int(engine.vocab_size)
    prompt_lo, prompt_hi = _span(args.prompt_len)
    out_lo, out_hi = _span(args.max_tokens)
    total = args.requests
    every = args.sample_every or max(1, total // 50)
    samples: list[dict[str, float]] = []
    lock = threading.Lock()
    finished = [0]
    all_done = threading.Event()
    start = time.perf_counter()
    samples.append({"requests": 0, "rss_mb": rss_mb(), "elapsed_s": 0.0})

    def on_done(_future: Any) -> None:
        with lock:
            finished[0] += 1
            n = finished[0]
        if n % every == 0 or n == total:
            samples.append(
                {"requests": n, "rss_mb": rss_mb(), "elapsed_s": time.perf_counter() - start}
            )
        if n == total:
            all_done.set()

    def produce(tenant: int, count: int, host: EngineHost) -> None:
        rng = random.Random(args.seed * 1000 + tenant)
        for i in range(count):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(prompt_lo, prompt_hi))]
            n = 4 if rng.random() < args.n_share else 1
            params = SamplingParams(
                max_tokens=rng.randint(out_lo, out_hi), temperature=0.0, n=n, seed=i
            )
            request_id = f"t{tenant}-{i}"
            host.submit(
                prompt,
                params,
                group=f"t{tenant}-batch-{i // args.batch_size}",
                tenant=f"tenant-{tenant}",
                request_id=request_id,
                callback=on_done,
            )
            if rng.random() < args.abort_share:
                host.abort(request_id)

    shares = [total // args.tenants + (t < total % args.tenants) for t in range(args.tenants)]
    host = EngineHost(engine).start()
    try:
        producers = [
            threading.Thread(target=produce, args=(t, shares[t], host), name=f"producer-{t}")
            for t in range(args.tenants)
        ]
        for t in producers:
            t.start()
        last = 0
        while not all_done.wait(10.0):
            with lock:
                n = finished[0]
            elapsed = time.perf_counter() - start
            print(
                f"  {n:>9,} requests  {elapsed:7.0f} s  {n / max(elapsed, 1e-9):7.0f} req/s  "
                f"RSS {rss_mb():7.1f} MB",
                file=sys.stderr,
                flush=True,
            )
            if n == last and not any(t.is_alive() for t in producers):
                raise RuntimeError(f"stalled at {n} of {total} requests")
            last = n
        for t in producers:
            t.join()
        elapsed = time.perf_counter() - start
        stats = host.stats()
        waiting = engine.scheduler.waiting
        left = {
            "waiting_queue_heap": len(waiting.heap),
            "prefix_buckets": len(waiting.buckets),
            "prefix_bucket_entries": sum(map(len, waiting.buckets.values())),
            "engine_requests": len(engine.requests),
            "host_pending": stats.pending,
            "host_in_flight": stats.in_flight,
        }
    finally:
        host.shutdown()
    return _figures(args, samples, elapsed, stats, left)


def _figures(
    args: argparse.Namespace,
    samples: list[dict[str, float]],
    elapsed: float,
    stats: Any,
    left: dict[str, int],
) -> dict[str, Any]:
    total = args.requests
    warm = int(total * args.warmup)
    after = [s for s in samples if s["requests"] >= warm and s["requests"] > 0]
    at_warm, at_end = after[0], samples[-1]
    growth = at_end["rss_mb"] - at_warm["rss_mb"]
    span = at_end["requests"] - at_warm["requests"]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": total,
        "elapsed_s": elapsed,
        "requests_per_s": total / elapsed if elapsed > 0 else 0.0,
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_at_warmup_mb": at_warm["rss_mb"],
        "warmup_requests": at_warm["requests"],
        "rss_at_end_mb": at_end["rss_mb"],
        "rss_peak_mb": max(s["rss_mb"] for s in samples),
        "growth_after_warmup_mb": growth,
        "growth_mb_per_10k_requests": growth / span * 10_000 if span else 0.0,
        "host": {
            "completed": stats.completed,
            "aborted": stats.aborted,
            "failed": stats.failed,
            "suspended": stats.suspended,
            "engine_steps": stats.engine.num_steps,
            "engine_preemptions": stats.engine.num_preemptions,
        },
        "left_after_run": left,
        "samples": samples,
    }


def print_report(r: dict[str, Any]) -> None:
    print(
        f"{r['requests']:,} requests in {r['elapsed_s']:.0f} s ({r['requests_per_s']:.0f} req/s); "
        f"host: {r['host']['completed']:,} completed, {r['host']['aborted']:,} aborted, "
        f"{r['host']['suspended']:,} suspended for fair shares"
    )
    print(f"{'requests':>10}  {'RSS MB':>8}  {'seconds':>8}")
    for s in r["samples"]:
        print(f"{int(s['requests']):>10,}  {s['rss_mb']:>8.1f}  {s['elapsed_s']:>8.1f}")
    print(
        f"RSS: {r['rss_start_mb']:.1f} MB at start, {r['rss_at_warmup_mb']:.1f} MB after the "
        f"warm-up ({r['warmup_requests']:,} requests), {r['rss_at_end_mb']:.1f} MB at the end "
        f"(peak {r['rss_peak_mb']:.1f} MB)"
    )
    print(
        f"growth after the warm-up: {r['growth_after_warmup_mb']:+.1f} MB "
        f"({r['growth_mb_per_10k_requests']:+.2f} MB per 10,000 requests)"
    )
    print("left in the engine and host after the run: " + json.dumps(r["left_after_run"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.tenants < 1 or args.batch_size < 1:
        raise SystemExit("--requests, --tenants and --batch-size must be at least 1")
    if not 0.0 <= args.warmup < 1.0:
        raise SystemExit("--warmup is a fraction in [0, 1)")
    results = run(args)
    print_report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
