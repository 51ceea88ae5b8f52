"""The API's own capacity: status polls and lists per second from 1, 2 and 4 API processes.

    python -m benchmarks.api_capacity
    python -m benchmarks.api_capacity --processes 1,2 --clients 32 --duration 8
    python -m benchmarks.api_capacity --base HEAD~3 --processes 1 --rounds 3  # before / after

Clients poll batches while they wait (``GET /v1/batches/{id}``) and dashboards and scripts
list them (``GET /v1/batches?limit=20``): those two routes are most of what an API process
serves. This starts the real API, as ``batchd up`` runs it (``core.launch.api_command``:
uvicorn, with ``--workers N`` for N processes in prometheus-client's multiprocess mode), on a
fresh Postgres database and a private Redis, with the rate limit off, and a few dozen batches
in the database. Then ``--clients`` concurrent clients, each one keep-alive connection over
loopback, send one kind of request after another for ``--duration`` seconds (after
``--warmup``), first polls of the batches in turn, then lists.

Reported per process count and kind: requests per second, p50 and p99 latency, the CPU
seconds the API processes used per request (uvicorn's manager and its workers, from /proc),
and the load generator's own CPU per request: it shares the machine's cores with the API, so
it is one asyncio process writing raw HTTP/1.1 requests and reading the responses by their
``Content-Length`` (far cheaper than an HTTP client library), and its share is printed.

The key is a stored one (``--key stored``, looked up in the database on every request, as
``batchd keys create`` makes them) or a static ``BATCHD_API_KEYS`` one (``--key static``).
With ``--base REV`` the API of that revision (the whole tree, exported with ``git archive``)
is measured too, on the same database, in alternating order, and the ratio printed; with
``--rounds N`` everything is measured N times and the medians reported (on a shared machine
one round's figures move by a third).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from testkit.bench.revisions import REPO, export_tree

_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")


def seed_batches(database_url: str, tenant: str, count: int) -> list[str]:
    """``count`` batches of ``tenant`` in assorted statuses (rows as the service writes
    them), newest last; returns their ids."""
    from core.batches import ids
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File

    statuses = ("in_progress", "completed", "validating", "finalizing", "failed")
    made: list[str] = []
    with session_scope(database_url) as session:
        for i in range(count):
            created = now() + timedelta(milliseconds=i)
            file_id = ids.file_id()
            session.add(File(id=file_id, tenant=tenant, purpose="batch", filename=f"in-{i}.jsonl",
                             bytes=1000, storage_key=f"files/{file_id}", created_at=created,
                             expires_at=created + timedelta(days=30)))  # fmt: skip
            batch = Batch(id=ids.batch_id(), tenant=tenant, endpoint="/v1/chat/completions",
                          model="batchd-demo", input_file_id=file_id, completion_window="24h",
                          status=statuses[i % len(statuses)], created_at=created,
                          expires_at=created + timedelta(hours=24), in_progress_at=created,
                          metadata_={"job": f"nightly-{i}"}, request_total=1000,
                          request_completed=400 + i, request_failed=3, input_tokens=40_000,
                          output_tokens=12_000)  # fmt: skip
            session.add(batch)
            made.append(batch.id)
    return made


def stored_key(database_url: str, tenant: str) -> str:
    from core.database import auth
    from core.database.sessions import session_scope

    with session_scope(database_url) as session:
        _row, plaintext = auth.create_key(session, tenant, "api capacity benchmark")
    return plaintext


# -- the load generator


async def _client(
    port: int, requests: list[bytes], offset: int, window: tuple[float, float], out: dict
) -> None:
    """One keep-alive connection sending ``requests`` in turn (from ``offset``) until the
    window ends; latencies of the requests started inside the window go to ``out``."""
    start, end = window
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while True:
            began = time.perf_counter()
            if began >= end:
                return
            writer.write(requests[i % len(requests)])
            i += 1
            head = await reader.readuntil(b"\r\n\r\n")
            match = _LENGTH.search(head)
            if match is None:
                raise RuntimeError(f"a response without Content-Length: {head[:200]!r}")
            await reader.readexactly(int(match.group(1)))
            if began >= start:
                out["latencies"].append(time.perf_counter() - began)
                if head[9:12] != b"200":
                    out["errors"] += 1
    finally:
        writer.close()


def drive(port: int, requests: list[bytes], clients: int, warmup: float, duration: float):
    """(latencies of the measured window, errors, (wall start, wall end) of the window)."""
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    out: dict[str, Any] = {"latencies": [], "errors": 0}
    start = time.perf_counter() + warmup
    window = (start, start + duration)

    async def main() -> None:
        await asyncio.gather(*(_client(port, requests, c * 7, window, out) for c in range(clients)))

    loop = loop_factory()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return out["latencies"], out["errors"], window


def http_get(path: str, key: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        "Accept: application/json\r\n\r\n"
    ).encode()


# -- the API processes


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every process under it (uvicorn's manager and workers)."""
    from cli.procfs import children, process_cpu_s

    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += process_cpu_s(p)
        except OSError:
            continue
        todo.extend(children(p))
    return total


class Api:
    """``batchd up``'s API command for ``processes`` processes, run from ``tree``."""

    def __init__(self, tree: Path, env: dict[str, str], processes: int, work: Path):
        from cli.main import api_metrics_env
        from cli.perf.service import free_port
        from core.launch import api_command
        from core.settings import Settings

        self.port = free_port()
        metrics_dir = work / f"metrics-{secrets.token_hex(3)}"
        settings = Settings(home=work, metrics_enabled=True)
        env = {**env, **api_metrics_env(settings, processes, metrics_dir)}
        env["PYTHONPATH"] = str(tree)
        self.log = (work / f"api-{self.port}.log").open("wb")
        cmd = api_command(self.port, workers=processes, log_level="warning")
        self.proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.processes = processes

    def wait_ready(self, timeout: float = 60.0) -> None:
        from cli.perf.service import api_up
        from cli.procfs import children

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the API exited: {Path(self.log.name).read_text()[-3000:]}")
            workers = len(children(self.proc.pid)) if self.processes > 1 else 1
            if workers >= self.processes and api_up(self.port):
                time.sleep(1.0 if self.processes > 1 else 0.2)  # every worker listening
                return
            time.sleep(0.2)
        raise TimeoutError(f"the API did not start: {Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def measure(api: Api, requests: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    cpu0, gen0 = tree_cpu_s(api.proc.pid), time.process_time()
    latencies, errors, (start, end) = drive(
        api.port, requests, args.clients, args.warmup, args.duration
    )
    # CPU is read over the whole drive (warm-up included) and scaled to the measured window.
    api_cpu, gen_cpu = tree_cpu_s(api.proc.pid) - cpu0, time.process_time() - gen0
    whole = args.warmup + args.duration
    n = len(latencies)
    if n == 0:
        raise RuntimeError("no request finished in the measured window")
    per_s = n / (end - start)
    ordered = sorted(latencies)
    return {
        "requests": n,
        "errors": errors,
        "per_s": per_s,
        "p50_ms": ordered[n // 2] * 1000,
        "p99_ms": ordered[min(n - 1, int(n * 0.99))] * 1000,
        "api_cpu_ms_per_req": api_cpu / (per_s * whole) * 1000,
        "loadgen_cpu_ms_per_req": gen_cpu / (per_s * whole) * 1000,
    }


def run_tree(
    tree: Path, env: dict[str, str], processes: int, work: Path, kinds: dict[str, list[bytes]],
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    api = Api(tree, env, processes, work)
    try:
        api.wait_ready()
        return {kind: measure(api, requests, args) for kind, requests in kinds.items()}
    finally:
        api.stop()


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, per kind of request."""
    return {
        kind: {k: statistics.median(r[kind][k] for r in results) for k in results[0][kind]}
        for kind in results[0]
    }


def _line(label: str, kind: str, r: dict[str, Any]) -> str:
    return (
        f"{label:>12} {kind:>5}: {r['per_s']:7.0f} req/s, p50 {r['p50_ms']:6.1f} ms, p99 "
        f"{r['p99_ms']:6.1f} ms, API {r['api_cpu_ms_per_req']:.2f} CPU-ms/req, load generator "
        f"{r['loadgen_cpu_ms_per_req']:.2f} CPU-ms/req"
        + (f", {r['errors']} errors" if r["errors"] else "")
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.api_capacity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--processes", default="1,2,4", help="API process counts (1,2,4)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent connections (32)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured (8)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before (2)")
    parser.add_argument("--batches", type=int, default=30, help="batches in the database (30)")
    parser.add_argument("--key", choices=("stored", "static"), default="stored")
    parser.add_argument("--base", help="also measure the API of this git revision")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds, in alternating order; medians (1)"
    )
    parser.add_argument(
        "--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    counts = [int(p) for p in args.processes.split(",")]

    from testkit.service.stack import BENCH_API_KEY, Broker, Database, service_env

    work = Path(tempfile.mkdtemp(prefix="batchd-api-capacity-"))
    db = Database(args.pg_admin_url, prefix="batchd_api_capacity")
    broker = None
    report: dict[str, Any] = {"clients": args.clients, "key": args.key, "runs": {}}
    try:
        broker = Broker(work)
        env = service_env(work, db.url, broker.url, BATCHD_RATE_LIMIT_PER_MINUTE="0",
                          BATCHD_MODELS=json.dumps({"batchd-demo": "demo:llama-tiny"}))  # fmt: skip
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        key = BENCH_API_KEY if args.key == "static" else stored_key(db.url, "default")
        batch_ids = seed_batches(db.url, "default", args.batches)
        kinds = {
            "poll": [http_get(f"/v1/batches/{b}", key) for b in batch_ids],
            "list": [http_get("/v1/batches?limit=20", key)],
        }
        trees = {"this tree": REPO}
        if args.base:
            trees[args.base] = export_tree(args.base, work / "tree")
        rounds: dict[str, dict[int, list[dict[str, Any]]]] = {}
        for r in range(args.rounds):
            for processes in counts:
                order = list(trees.items())
                for label, tree in order if (processes + r) % 2 else reversed(order):
                    result = run_tree(tree, env, processes, work, kinds, args)
                    rounds.setdefault(label, {}).setdefault(processes, []).append(result)
                    for kind, one in result.items():
                        print(_line(f"{label} x{processes}", kind, one), flush=True)
        for label, by_count in rounds.items():
            for processes, results in by_count.items():
                report["runs"].setdefault(label, {})[processes] = median_of(results)
        if args.rounds > 1:
            print(f"median of {args.rounds} rounds:")
            for label, by_count in report["runs"].items():
                for processes, result in by_count.items():
                    for kind, one in result.items():
                        print(_line(f"{label} x{processes}", kind, one), flush=True)
    finally:
        if broker is not None:
            broker.stop()
        db.drop()
        shutil.rmtree(work, ignore_errors=True)
    if args.base:
        report["ratio"] = {
            str(p): {
                kind: report["runs"]["this tree"][p][kind]["per_s"]
                / report["runs"][args.base][p][kind]["per_s"]
                for kind in ("poll", "list")
            }
            for p in counts
        }
        for p, ratios in report["ratio"].items():
            print(
                f"x{p}: this tree / {args.base}: polls {ratios['poll']:.2f}x, "
                f"lists {ratios['list']:.2f}x req/s"
            )
    head = report["runs"]["this tree"]
    if len(counts) > 1:
        first, last = counts[0], counts[-1]
        print(
            f"{last} processes / {first}: polls "
            f"{head[last]['poll']['per_s'] / head[first]['poll']['per_s']:.2f}x, lists "
            f"{head[last]['list']['per_s'] / head[first]['list']['per_s']:.2f}x req/s "
            f"on {len(os.sched_getaffinity(0))} CPUs shared with the load generator"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
