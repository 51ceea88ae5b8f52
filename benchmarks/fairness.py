"""Fair sharing and priority, measured on the whole service.

Starts the API, a control worker, a model worker (the tiny demo model) and beat on a fresh
Postgres database and Redis, then measures, side by side in one run:

1. the big job (tenant A, ``--big`` requests of ``--max-tokens``) alone, before the first
   round and after each: its time and the engine's mean occupancy (running sequences /
   max_num_seqs) while it ran;
2. ``--rounds`` rounds of: a small job (tenant B, ``--small`` requests of
   ``--small-max-tokens``) alone, the median of three runs; the same small job submitted
   ``--delay`` seconds after the big job (its completion time against the round's time alone;
   the big job's throughput against the mean of the two alone runs around the round, per
   second and per CPU second of the model worker); then the same with the small job ``high``
   priority and of tenant A (same-tenant bulk). The medians over the rounds are the figures:
   one run of each swings by 10-20% on a shared machine, and the machine's speed drifts
   between rounds. A small job's status is polled every 20 ms (it takes about half a second).

Each service process runs ``--threads`` torch threads (default 1: on a shared machine more
intra-op threads spin at barriers and make every figure swing).

The default is the fair-admission scenario: a 1,200-request job in one shard, then another
tenant's 16-request job a quarter of the way through it (``--delay``). Targets: small job
<= 2x alone, big job throughput within 5% of alone; the high-priority job <= 1.5x alone;
occupancy as alone. Engine steps (from the model
worker's ``engine_stats``) are printed next to seconds: on a CPU a step with more sequences
takes longer, so seconds mix scheduling delay with step cost; steps do not.

    .venv/bin/python -m benchmarks.fairness                      # the scenario above
    .venv/bin/python -m benchmarks.fairness --big 300 --delay 3  # quicker
    .venv/bin/python -m benchmarks.fairness --shard-requests 16 --big 600 --max-tokens 8 \
        --small 20 --small-max-tokens 8 --max-num-seqs 16 --delay 0  # many shards

Needs Postgres (``--pg-admin-url``, trust auth) and Redis (``--redis-url``) as the tests do.
The helpers below (``chat_lines``, ``submit``, ``wait``, ``alone``, ``contended``) are shared
with ``tests/e2e/test_fairness.py``.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cli.perf.workload import request_line

MODEL = "batchd-demo"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


# ---------------------------------------------------------------------------------------------
# Helpers shared with the e2e test


class Hold(Protocol):
    """A gate in the model worker's engine (testkit.engine_gate.FileGate)."""

    marker: str

    def close(self) -> None: ...

    def open(self) -> None: ...


def chat_lines(prefix: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        request_line(
            f"{prefix}-{i}",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{prefix} request number {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        for i in range(n)
    ]


def submit(client: Any, lines: list[dict[str, Any]], **extra: Any) -> tuple[Any, float]:
    """Upload and create; the batch and the monotonic time of its creation."""
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body=extra or None,
    )
    return batch, started


# How often a small job's status is polled: its time alone is about half a second, so polling
# every 0.1 s would add up to 20% to either side of its ratio.
SMALL_POLL_S = 0.02


def wait(
    client: Any, batch_id: str, timeout: float, until=None, poll_s: float = 0.1
) -> tuple[Any, float]:
    """Poll every ``poll_s`` until ``until(batch)`` (default: terminal); the batch and the
    monotonic time."""
    until = until or (lambda b: b.status in TERMINAL)
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch, time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} is {batch.status} after {timeout}s")
        time.sleep(poll_s)


# Engine counters of the model worker, or None (the harness's ``EngineStatsProbe`` wrapped).
Probe = Callable[[], dict[str, Any] | None]
# CPU seconds the model worker has used so far (steadier than wall time on a shared machine).
CpuClock = Callable[[], float]


@dataclass
class Timing:
    s: float  # create -> completed
    steps: int | None = None  # engine steps meanwhile (with a probe)
    occupancy: float | None = None  # mean running sequences / max_num_seqs meanwhile
    cpu_s: float | None = None  # model worker CPU seconds meanwhile (with a CPU clock)


def engine_counters(probe: Probe | None) -> dict[str, Any] | None:
    """The model's engine stats from the model worker (``engine_stats``), or None. A busy
    worker may miss a one-second reply window: ask a few times."""
    for _ in range(5 if probe is not None else 0):
        answer = probe()
        stats = (answer or {}).get("models", {}).get(MODEL)
        if stats and "num_steps" in stats:
            return stats
    return None


def _timing(seconds: float, before: dict | None, after: dict | None) -> Timing:
    if not before or not after or "num_steps" not in before or "num_steps" not in after:
        return Timing(seconds)
    steps = after["num_steps"] - before["num_steps"]
    seq_steps = after["total_running_seq_steps"] - before["total_running_seq_steps"]
    occupancy = seq_steps / steps / after["max_num_seqs"] if steps else None
    return Timing(seconds, steps, occupancy)


def alone(
    client: Any,
    n: int,
    max_tokens: int,
    timeout: float,
    probe: Probe | None = None,
    cpu: CpuClock | None = None,
    poll_s: float = 0.1,
    **extra: Any,
) -> Timing:
    """Create to completed for a job on an idle service, its status polled every ``poll_s``."""
    before = engine_counters(probe)
    cpu0 = cpu() if cpu else None
    batch, started = submit(client, chat_lines("alone", n, max_tokens), **extra)
    done, ended = wait(client, batch.id, timeout, poll_s=poll_s)
    assert done.status == "completed", done
    timing = _timing(ended - started, before, engine_counters(probe))
    if cpu and cpu0 is not None:
        timing.cpu_s = cpu() - cpu0
    return timing


@dataclass
class Contended:
    small: Timing  # create -> completed of the small job
    big_s: float | None  # create -> completed of the big job (None if it was cancelled)
    small_done_first: bool
    big_done_at_small_end: int  # big job's requests done when the small one completed
    big_first_s: float | None = None  # create -> first completed requests of the big job
    big_cpu_s: float | None = None  # model worker CPU seconds from big create to big completed


def contended(
    big_client: Any,
    small_client: Any,
    *,
    big: int,
    small: int,
    max_tokens: int,
    timeout: float,
    small_max_tokens: int | None = None,
    delay_s: float | None = None,
    small_extra: dict[str, Any] | None = None,
    finish_big: bool = True,
    probe: Probe | None = None,
    cpu: CpuClock | None = None,
    hold: Hold | None = None,
) -> Contended:
    """The big job first; the small one ``delay_s`` seconds after the big one was created
    (default: once the big one has completed requests); measure both.

    ``hold`` (a gate in the model worker's engine, testkit.engine_gate): the big job's
    fifth line carries its marker, so the engine holds once the big job's first requests are
    done and its next ones admitted, until the small job has been validated: its start-up
    (wall time) then costs no engine steps, and the big job has as much left when the small
    one can run on a fast machine as on a slow one."""
    cpu0 = cpu() if cpu else None
    big_lines = chat_lines("big", big, max_tokens)
    if hold is not None:
        hold.close()
        big_lines[4]["body"]["messages"][0]["content"] += f" {hold.marker}"
    big_batch, big_started = submit(big_client, big_lines)
    big_first_s = None
    if delay_s is None:
        _, first_at = wait(
            big_client, big_batch.id, timeout, until=lambda b: b.request_counts.completed > 0
        )
        big_first_s = first_at - big_started
    else:
        time.sleep(max(0.0, big_started + delay_s - time.monotonic()))
    before = engine_counters(probe)
    small_lines = chat_lines("small", small, small_max_tokens or max_tokens)
    small_batch, small_started = submit(small_client, small_lines, **(small_extra or {}))
    if hold is not None:
        try:
            wait(small_client, small_batch.id, timeout, until=lambda b: b.status != "validating")
        finally:
            hold.open()
    small_done, small_ended = wait(small_client, small_batch.id, timeout, poll_s=SMALL_POLL_S)
    small_timing = _timing(small_ended - small_started, before, engine_counters(probe))
    assert small_done.status == "completed", small_done
    big_now = big_client.batches.retrieve(big_batch.id)
    first = big_now.status not in TERMINAL
    big_s = big_cpu_s = None
    if finish_big:
        big_done, big_ended = wait(big_client, big_batch.id, timeout)
        assert big_done.status == "completed", big_done
        big_s = big_ended - big_started
        if cpu and cpu0 is not None:
            big_cpu_s = cpu() - cpu0
    else:
        import contextlib

        import openai

        # It may finish between the small job's end and the cancel: nothing to stop then.
        with contextlib.suppress(openai.ConflictError):
            big_client.batches.cancel(big_batch.id)
        wait(big_client, big_batch.id, timeout)
    return Contended(
        small_timing, big_s, first, big_now.request_counts.completed, big_first_s, big_cpu_s
    )


def tenant_key(database_url: str, tenant: str) -> str:
    """A new API key of ``tenant``, written to the database directly (like ``batchd keys``),
    that may create batches of any priority."""
    from core.database.auth import create_key
    from core.database.sessions import session_scope

    with session_scope(database_url) as session:
        _row, plaintext = create_key(session, tenant, "bench", max_priority="high")
    return plaintext


# ---------------------------------------------------------------------------------------------
# The stand-alone benchmark


def _start_stack(root: Path, database_url: str, redis_url: str, args: argparse.Namespace):
    from cli.perf.service import free_port
    from testkit.service import stack as bs

    env = bs.service_env(
        root,
        database_url,
        redis_url,
        BATCHD_SHARD_MAX_REQUESTS=str(args.shard_requests),
        BATCHD_CHECKPOINT_EVERY="8",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_WORKER_SHARD_CONCURRENCY=str(args.concurrency),
        BATCHD_MAX_RELEASED_SHARDS_PER_MODEL=str(args.released),
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        OMP_NUM_THREADS=str(args.threads),
        BATCHD_ENGINE_OPTIONS=json.dumps(
            {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
        ),
    )
    del env["BATCHD_API_KEYS"]  # the tenants' keys are in the database
    stack = bs.Stack(root, env, free_port())
    stack.start_roles(("api", "control", "model", "beat"), args.concurrency)
    stack.wait_ready(180)
    return stack.base_url, stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=1200, help="requests in the big job")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens, big job")
    parser.add_argument("--small", type=int, default=16, help="requests in the small job")
    parser.add_argument("--small-max-tokens", type=int, default=48, help="output tokens, small")
    parser.add_argument(
        "--delay",
        type=float,
        help="small job's delay after the big one, seconds (default: a quarter of the big "
        "job's time alone, so the small one always arrives while the big one fills the engine)",
    )
    parser.add_argument("--shard-requests", type=int, default=2000, help="requests per shard")
    parser.add_argument("--concurrency", type=int, default=2, help="shard threads per worker")
    parser.add_argument("--released", type=int, default=2, help="max released shards/model")
    parser.add_argument(
        "--max-num-seqs", type=int, help="engine batch size (default: the engine's, by device)"
    )
    parser.add_argument(
        "--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the contended runs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per service process (default 1)"
    )
    args = parser.parse_args()

    import redis
    from openai import OpenAI

    from core.llms.demo import build
    from testkit.service.stack import Database, EngineStatsProbe

    build("llama-tiny")
    db = Database(args.pg_admin_url)
    database_url = db.url
    broker = redis.Redis.from_url(args.redis_url)
    for key in broker.keys("batchd.*"):
        broker.delete(key)
    stack = None
    probe = EngineStatsProbe(args.redis_url)
    try:
        with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
            base_url, stack = _start_stack(Path(tmp), database_url, args.redis_url, args)
            a = OpenAI(base_url=base_url, api_key=tenant_key(database_url, "tenant-a"))
            b = OpenAI(base_url=base_url, api_key=tenant_key(database_url, "tenant-b"))
            result = _measure(args, a, b, probe, stack.pids()["model"])
            stack.stop()
    finally:
        probe.close()
        if stack is not None:
            stack.stop()
        db.drop()
    _report(args, result)


@dataclass
class Round:
    fair: Contended  # tenant B's small job behind tenant A's big one
    prio: Contended  # a high-priority job behind the same tenant's bulk
    before: Timing  # the big job alone just before and just after this round
    after: Timing
    small_alone: Timing  # the small job alone in this round (the median of three)

    def big_ratio(self, c: Contended) -> float:
        """The big job's throughput beside the small one over alone (the mean of the two
        alone runs around this round): > 1 is faster."""
        return (self.before.s + self.after.s) / 2 / (c.big_s or float("nan"))

    def big_cpu_ratio(self, c: Contended) -> float:
        alone_cpu = ((self.before.cpu_s or 0) + (self.after.cpu_s or 0)) / 2
        return alone_cpu / c.big_cpu_s if c.big_cpu_s else float("nan")


def _measure(args: argparse.Namespace, a: Any, b: Any, probe: Any, model_pid: int) -> dict:
    """``--rounds`` rounds of the small job alone (the median of three) and both contended
    scenarios, the big job alone before the first round and after each. Each ratio is against
    the alone runs of its own round: the machine's speed drifts between rounds."""
    timeout = 3600.0

    from cli.procfs import process_cpu_s

    def cpu() -> float:
        return process_cpu_s(model_pid)

    alone(b, 4, 2, timeout)  # warm-up (first-request costs)
    max_num_seqs = (engine_counters(probe) or {}).get("max_num_seqs", args.max_num_seqs)

    def small_alone() -> Timing:
        runs = [
            alone(b, args.small, args.small_max_tokens, timeout, probe, poll_s=SMALL_POLL_S)
            for _ in range(3)
        ]
        return sorted(runs, key=lambda t: t.s)[1]

    common = {
        "big": args.big,
        "small": args.small,
        "max_tokens": args.max_tokens,
        "small_max_tokens": args.small_max_tokens,
        "timeout": timeout,
        "probe": probe,
        "cpu": cpu,
    }
    bigs = [alone(a, args.big, args.max_tokens, timeout, probe, cpu)]
    delay = args.delay if args.delay is not None else bigs[0].s / 4
    rounds = []
    for _ in range(args.rounds):
        small = small_alone()
        fair = contended(a, b, delay_s=delay, **common)
        prio = contended(a, a, delay_s=delay, small_extra={"priority": "high"}, **common)
        bigs.append(alone(a, args.big, args.max_tokens, timeout, probe, cpu))
        rounds.append(Round(fair, prio, bigs[-2], bigs[-1], small))
    return {
        "max_num_seqs": max_num_seqs,
        "bigs": bigs,
        "rounds": rounds,
        "delay_s": delay,
    }


def _report(args: argparse.Namespace, result: dict) -> None:
    import statistics

    bigs: list[Timing] = result["bigs"]
    rounds: list[Round] = result["rounds"]
    shards = -(-args.big // args.shard_requests)
    print(
        f"service: tiny demo model, max_num_seqs={result['max_num_seqs']}, {args.concurrency} "
        f"shard threads, max_released_shards_per_model={args.released}, {args.shard_requests} "
        f"requests/shard, {args.threads} torch thread(s) per process"
    )
    print(
        f"big job: {args.big} requests x {args.max_tokens} output tokens ({shards} shard(s)); "
        f"small job: {args.small} x {args.small_max_tokens}, created {result['delay_s']:.1f}s "
        f"after it; "
        f"{len(rounds)} round(s)"
    )
    print(
        "big job alone: "
        + ", ".join(f"{t.s:.2f} s" for t in bigs)
        + f" (mean occupancy {statistics.mean(t.occupancy or 0 for t in bigs):.3f}); small "
        "job alone (tenant B, the median of 3 in each round): "
        + ", ".join(f"{r.small_alone.s:.2f} s ({r.small_alone.steps or '-'} steps)" for r in rounds)
    )
    head = f"{'round':<6} {'scenario':<30} {'small s':>8} {'x alone':>8} {'steps':>6} "
    print(head + f"{'x alone':>8} {'big x alone':>12} {'per cpu-s':>10} {'done first':>11}")
    for i, r in enumerate(rounds, 1):
        small_alone = r.small_alone
        for label, c in (
            ("B's small job behind A's bulk", r.fair),
            ("high behind own bulk", r.prio),
        ):
            steps = "-" if c.small.steps is None else str(c.small.steps)
            step_ratio = (
                f"{c.small.steps / small_alone.steps:.2f}"
                if c.small.steps and small_alone.steps
                else "-"
            )
            print(
                f"{i:<6} {label:<30} {c.small.s:>8.2f} {c.small.s / small_alone.s:>8.2f} "
                f"{steps:>6} {step_ratio:>8} {r.big_ratio(c):>12.3f} {r.big_cpu_ratio(c):>10.3f} "
                f"{str(c.small_done_first):>11}"
            )

    def med(values: list[float]) -> float:
        return statistics.median(values)

    summary = {
        "max_num_seqs": result["max_num_seqs"],
        "rounds": len(rounds),
        "delay_s": round(result["delay_s"], 2),
        "small_alone_s": [round(r.small_alone.s, 3) for r in rounds],
        "small_alone_steps": [r.small_alone.steps for r in rounds],
        "big_alone_s": [round(t.s, 3) for t in bigs],
        "big_alone_occupancy": statistics.mean(t.occupancy or 0 for t in bigs),
        "fair_ratio": med([r.fair.small.s / r.small_alone.s for r in rounds]),
        "priority_ratio": med([r.prio.small.s / r.small_alone.s for r in rounds]),
        "big_throughput_ratio_small": med([r.big_ratio(r.fair) for r in rounds]),
        "big_throughput_ratio_high": med([r.big_ratio(r.prio) for r in rounds]),
        "big_cpu_throughput_ratio_small": med([r.big_cpu_ratio(r.fair) for r in rounds]),
        "big_cpu_throughput_ratio_high": med([r.big_cpu_ratio(r.prio) for r in rounds]),
        "small_done_first": all(
            r.fair.small_done_first and r.prio.small_done_first for r in rounds
        ),
    }
    print(
        f"medians: small behind bulk {summary['fair_ratio']:.2f}x alone (target <= 2), high "
        f"behind own bulk {summary['priority_ratio']:.2f}x (<= 1.5); big job throughput "
        f"{summary['big_throughput_ratio_small']:.3f} / {summary['big_throughput_ratio_high']:.3f}"
        f" of alone (within 5%), per model-worker cpu-s "
        f"{summary['big_cpu_throughput_ratio_small']:.3f} / "
        f"{summary['big_cpu_throughput_ratio_high']:.3f}"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
