"""CPU seconds and time per result line of one model worker serving a simulated model.

One model worker serving a simulated model (``engine.sim.simulator``): its CPU seconds per result
line and its result lines per second, on one chat batch.

A fresh Postgres database, a private Redis, the API, a control worker, beat and one model
worker (threads pool, ``BATCHD_WORKER_SHARD_CONCURRENCY`` shard threads) serving ``sim-8b``
(``--spec``, default ``sim:tokens_per_s=4000,max_num_seqs=256,ttft_ms=50``). One batch of
``--lines`` chat lines (``--max-tokens`` each, ``ignore_eos``) is uploaded and created; the
batch is polled until it completes. Measured between the batch's first committed lines and
its last (``request_counts.completed`` going from > 0 to all): result lines per second, and
the model worker's CPU time (``/proc/<pid>/stat`` utime + stime) per line over the same
interval, beside what the engine alone could give (``max_num_seqs`` lines every
``ttft + (max_tokens - 1) / tokens_per_s`` seconds) and the engine's mean occupancy::

    .venv/bin/python -m benchmarks.sim_worker                      # 2,000 lines of 64 tokens
    .venv/bin/python -m benchmarks.sim_worker --env BATCHD_SHARD_MAX_REQUESTS=250
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.perf.service import wait_for
from cli.perf.workload import request_line
from cli.procfs import process_cpu_s as cpu_s
from core.launch import QUIET, model_worker_command
from core.llms.specs import sim_spec
from testkit.service import stack as bs

SIM = "sim-8b"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="sim:tokens_per_s=4000,max_num_seqs=256,ttft_ms=50")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the service")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sim = sim_spec(args.spec)
    overrides = dict(item.split("=", 1) for item in args.env)
    work = Path(tempfile.mkdtemp(prefix="bench-sim-"))
    with bs.Run(work) as run:
        env = run.env(BATCHD_MODELS=json.dumps({SIM: args.spec}), **overrides)
        stack = run.stack(env).start_roles(["api", "control", "beat"])
        concurrency = int(env.get("BATCHD_WORKER_SHARD_CONCURRENCY", "8"))
        worker = model_worker_command([SIM], concurrency, "model@bench", extra=QUIET)
        stack.start("sim-model", worker, env)
        stack.wait_ready()
        wait_for(lambda: f"model {SIM} ready" in stack.log("sim-model"), 120, "the sim model")
        pid = stack.procs["sim-model"].pid
        data = work / "batch.jsonl"
        with data.open("w") as out:
            for i in range(args.lines):
                text = f"Summarise item {i} of the nightly report in two sentences, please."
                body = {
                    "model": SIM,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                line = request_line(f"r{i}", body)
                out.write(json.dumps(line) + "\n")
        client = stack.client()
        batch, _ = bs.upload_and_create(client, data, "/v1/chat/completions")
        start = None
        while True:
            b = client.batches.retrieve(batch.id)
            done = b.request_counts.completed if b.request_counts else 0
            if start is None and done > 0:
                start = (time.monotonic(), cpu_s(pid), done)
            if b.status in bs.TERMINAL or done >= args.lines:
                end = (time.monotonic(), cpu_s(pid), done)
                break
            time.sleep(0.05)
        wait_for(lambda: client.batches.retrieve(batch.id).status in bs.TERMINAL, 120, "end")
        final = client.batches.retrieve(batch.id)
        stats = bs.EngineStatsProbe(run.broker.url)(timeout=5) or {}  # type: ignore[union-attr]
        figures = _figures(args, sim, start, end, final, stats)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def _figures(args: Any, sim: Any, start: Any, end: Any, final: Any, stats: dict) -> dict:
    lines = end[2] - start[2]
    wall, cpu = end[0] - start[0], end[1] - start[1]
    seqs = sim.max_num_seqs or 128
    per_line_s = sim.ttft_ms / 1000 + (args.max_tokens - 1) / sim.tokens_per_s
    engine = stats.get("models", {}).get(SIM, {})
    return {
        "spec": args.spec,
        "lines": args.lines,
        "max_tokens": args.max_tokens,
        "status": final.status,
        "measured_lines": lines,
        "wall_s": round(wall, 3),
        "lines_per_s": round(lines / wall, 1) if wall > 0 else None,
        "engine_alone_lines_per_s": round(seqs / per_line_s, 1),
        "model_worker_cpu_s": round(cpu, 3),
        "model_worker_cpu_ms_per_line": round(1000 * cpu / lines, 3) if lines else None,
        "model_worker_cpu_share": round(cpu / wall, 3) if wall > 0 else None,
        "engine_mean_occupancy": engine.get("mean_occupancy"),
        "engine_output_tokens": engine.get("total_output_tokens"),
        "usage": final.usage.model_dump() if final.usage else None,
    }


if __name__ == "__main__":
    main()
