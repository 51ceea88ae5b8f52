"""Fair sharing and priority, measured on the whole service.

Starts the API, a control worker, a model worker (the tiny demo model) and beat on a fresh
Postgres database and Redis, then measures, side by side in one run:

1. a small job (tenant B, ``--small`` requests) alone (the median of three runs);
2. the same small job submitted just after a big job of tenant A (``--big`` requests, many
   shards) has started: its completion time, the big job's, and the ratio to (1);
3. a ``high`` priority small job of tenant A submitted just after a ``normal`` bulk job of the
   same tenant: its completion time and the ratio to (1).

    .venv/bin/python scripts/bench_fairness.py            # 600-request big job, 20-request small
    .venv/bin/python scripts/bench_fairness.py --big 200  # quicker

Needs Postgres (``--pg-admin-url``, trust auth) and Redis (``--redis-url``) as the tests do.
The helpers below (``chat_lines``, ``submit``, ``wait``, ``contended``) are shared with
``tests/e2e/test_fairness.py``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = "batchd-demo"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


# ---------------------------------------------------------------------------------------------
# Helpers shared with the e2e test


def chat_lines(prefix: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{prefix} request number {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
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


def wait(client: Any, batch_id: str, timeout: float, until=None) -> tuple[Any, float]:
    """Poll until ``until(batch)`` (default: terminal); the batch and the monotonic time."""
    until = until or (lambda b: b.status in TERMINAL)
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch, time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} is {batch.status} after {timeout}s")
        time.sleep(0.1)


def alone(client: Any, n: int, max_tokens: int, timeout: float, **extra: Any) -> float:
    """Seconds from create to completed for a job on an idle service."""
    batch, started = submit(client, chat_lines("alone", n, max_tokens), **extra)
    done, ended = wait(client, batch.id, timeout)
    assert done.status == "completed", done
    return ended - started


@dataclass
class Contended:
    small_s: float  # create -> completed of the small job
    big_s: float | None  # create -> completed of the big job (None if it was cancelled)
    small_done_first: bool
    big_done_at_small_end: int  # big job's requests done when the small one completed


def contended(
    big_client: Any,
    small_client: Any,
    *,
    big: int,
    small: int,
    max_tokens: int,
    timeout: float,
    small_extra: dict[str, Any] | None = None,
    finish_big: bool = True,
) -> Contended:
    """The big job first; once it runs, the small one; measure both."""
    big_batch, big_started = submit(big_client, chat_lines("big", big, max_tokens))
    wait(big_client, big_batch.id, timeout, until=lambda b: b.request_counts.completed > 0)
    small_batch, small_started = submit(
        small_client, chat_lines("small", small, max_tokens), **(small_extra or {})
    )
    small_done, small_ended = wait(small_client, small_batch.id, timeout)
    assert small_done.status == "completed", small_done
    big_now = big_client.batches.retrieve(big_batch.id)
    first = big_now.status not in TERMINAL
    big_s = None
    if finish_big:
        big_done, big_ended = wait(big_client, big_batch.id, timeout)
        assert big_done.status == "completed", big_done
        big_s = big_ended - big_started
    else:
        big_client.batches.cancel(big_batch.id)
        wait(big_client, big_batch.id, timeout)
    return Contended(small_ended - small_started, big_s, first, big_now.request_counts.completed)


def tenant_key(database_url: str, tenant: str) -> str:
    """A new API key of ``tenant``, written to the database directly (like ``batchd keys``)."""
    from core.auth import create_key
    from core.db import session_scope

    with session_scope(database_url) as session:
        _row, plaintext = create_key(session, tenant, "bench")
    return plaintext


# ---------------------------------------------------------------------------------------------
# The stand-alone benchmark


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_stack(root: Path, database_url: str, redis_url: str, args: argparse.Namespace):
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_BROKER_URL": redis_url,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",
        "BATCHD_SHARD_MAX_REQUESTS": str(args.shard_requests),
        "BATCHD_CHECKPOINT_EVERY": "8",
        "BATCHD_CHECKPOINT_INTERVAL_S": "0.5",
        "BATCHD_WORKER_SHARD_CONCURRENCY": str(args.concurrency),
        "BATCHD_MAX_RELEASED_SHARDS_PER_MODEL": str(args.released),
        "BATCHD_RELEASE_SWEEP_INTERVAL_S": "1",
        "BATCHD_ENGINE_OPTIONS": json.dumps({"max_num_seqs": args.max_num_seqs}),
    }
    (root / "home").mkdir(parents=True)
    celery = [sys.executable, "-m", "celery", "-A", "worker.celery_app"]
    quiet = ["--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    commands = {
        "api": [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"],
        "control": [*celery, "worker", "-Q", "batchd.control", "--pool", "threads", "-c", "2",
                    "-n", "control@bench", *quiet],
        "model": [*celery, "worker", "-Q", f"batchd.model.{MODEL}", "--pool", "threads",
                  "-c", str(args.concurrency), "-n", "model@bench", *quiet],
        "beat": [*celery, "beat", "-s", str(root / "home" / "beat"), "--loglevel", "INFO"],
    }  # fmt: skip
    procs = {}
    for name, cmd in commands.items():
        log = open(root / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 180
    import httpx

    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {(root / f'{name}.log').read_text()[-2000:]}")
        try:
            up = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            up = False
        if up and f"model {MODEL} ready" in (root / "model.log").read_text(errors="replace"):
            return f"http://127.0.0.1:{port}/v1", procs
        time.sleep(0.3)
    raise TimeoutError("the service did not start")


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=600, help="requests in the big job")
    parser.add_argument("--small", type=int, default=20, help="requests in the small job")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--shard-requests", type=int, default=16, help="requests per shard")
    parser.add_argument("--concurrency", type=int, default=2, help="shard threads per worker")
    parser.add_argument("--released", type=int, default=2, help="max released shards/model")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine batch size")
    parser.add_argument(
        "--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    import redis
    from openai import OpenAI
    from sqlalchemy import create_engine, text

    import migrations
    from engine.demo_models import build

    build("llama-tiny")
    name = f"batchd_bench_{secrets.token_hex(4)}"
    admin = create_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    database_url = args.pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    migrations.upgrade(database_url)
    broker = redis.Redis.from_url(args.redis_url)
    for key in broker.keys("batchd.*"):
        broker.delete(key)
    procs: dict[str, subprocess.Popen] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp:
            base_url, procs = _start_stack(Path(tmp), database_url, args.redis_url, args)
            a = OpenAI(base_url=base_url, api_key=tenant_key(database_url, "tenant-a"))
            b = OpenAI(base_url=base_url, api_key=tenant_key(database_url, "tenant-b"))
            timeout = 3600.0
            alone(b, 4, 2, timeout)  # warm-up (first-request costs)
            runs = sorted(alone(b, args.small, args.max_tokens, timeout) for _ in range(3))
            small_alone = runs[1]  # the median of three
            fair = contended(
                a, b, big=args.big, small=args.small, max_tokens=args.max_tokens, timeout=timeout
            )
            prio = contended(
                a,
                a,
                big=args.big,
                small=args.small,
                max_tokens=args.max_tokens,
                timeout=timeout,
                small_extra={"priority": "high"},
            )
            _stop(procs)
    finally:
        _stop(procs)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    shards = -(-args.big // args.shard_requests)
    print(
        f"service: tiny demo model, max_num_seqs={args.max_num_seqs}, {args.concurrency} shard "
        f"threads, max_released_shards_per_model={args.released}, {args.shard_requests} "
        f"requests/shard, {args.max_tokens} output tokens/request"
    )
    print(f"big job: {args.big} requests ({shards} shards); small job: {args.small} requests")
    print(f"{'scenario':<44} {'small job s':>11} {'x alone':>8} {'big job s':>10}")
    print(f"{'small job alone (tenant B)':<44} {small_alone:>11.2f} {1.0:>8.2f} {'-':>10}")
    for label, r in (
        ("small job behind tenant A's big job", fair),
        ("high-priority job behind same tenant's bulk", prio),
    ):
        print(
            f"{label:<44} {r.small_s:>11.2f} {r.small_s / small_alone:>8.2f} {r.big_s:>10.2f}"
            f"   (small done first: {r.small_done_first}, big had {r.big_done_at_small_end}/"
            f"{args.big} done then)"
        )
    print(
        json.dumps(
            {
                "small_alone_s": round(small_alone, 3),
                "small_behind_big_s": round(fair.small_s, 3),
                "fair_ratio": round(fair.small_s / small_alone, 3),
                "big_s": round(fair.big_s or 0, 3),
                "high_behind_bulk_s": round(prio.small_s, 3),
                "priority_ratio": round(prio.small_s / small_alone, 3),
                "bulk_s": round(prio.big_s or 0, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
