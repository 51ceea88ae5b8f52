"""The control plane's result lines per second under a simulated fleet of 1 to 8 model workers.

The control plane under a simulated fleet: how many result lines per second one API, one
control worker, one Postgres and one Redis commit for 1, 2, 4 and 8 model workers.

The model workers serve the ``sim`` model (:mod:`engine.sim.simulator`: no network, deterministic
tokens at a configured per-sequence rate), so the engine is never what limits: what saturates is the
service around it. Each fleet size runs on its own fresh stack:

* a private Postgres server (``initdb`` in a temporary directory, ``pg_stat_statements``
  loaded; its processes are this run's alone, so their CPU and statements are measured
  exactly). Without ``initdb`` the shared server is used and statements are not counted;
* a private ``redis-server``; the API (uvicorn), the control worker, beat and ``N`` model
  workers (threads pool, ``--shard-concurrency`` shards each), started as ``batchd up`` and
  compose start them.

The workload: ``--batches`` chat batches of ``--lines`` lines in all (``max_tokens`` each),
created together. Sampled every half second: committed lines and output tokens (a read-only
query under its own role, left out of the statement counts) and every process's CPU time.

Reported per fleet size: result lines committed per second and output tokens per second over
the middle 80% of the lines (ramp-up and tail left out), p50/p99 of the lag from a request's
finish in the engine to its durable commit (``request_timings`` over remote control), each
process's CPU share of the run and CPU milliseconds per line, Postgres statements and
transactions per line, and which process saturates first. ``--out`` gets ``fleet.json`` and
``fleet.png`` (lines per second against workers)::

    python -m benchmarks.fleet --workers 1,2,4,8 --lines 20000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cli.perf.service import Procs, api_up, free_port, wait_for
from cli.perf.workload import chat_bodies, request_line
from core.launch import QUIET, worker_module_command
from testkit.bench.cpu import CpuMeter
from testkit.bench.postgres import BENCH_ROLE, PrivatePostgres
from testkit.bench.revisions import REPO, remove_worktree, worktree
from testkit.service.stack import BENCH_API_KEY, Broker, Database, api_command, service_env

MODEL = "sim-8b"
DEFAULT_SIM = "tokens_per_s=4000,max_num_seqs=256,ttft_ms=50"


# -- one fleet size


@dataclass
class Sample:
    t: float
    lines: int
    tokens: int


@dataclass
class Result:
    workers: int
    lines: int
    lines_per_s: float
    tokens_per_s: float
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    wall_s: float
    cpu_s: dict[str, float]
    statements_per_line: float | None
    transactions_per_line: float | None
    saturated: str
    peak_connections: int = 0
    top_statements: list[tuple[int, str]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def cpu_ms_per_line(self) -> dict[str, float]:
        return {k: 1000 * v / max(1, self.lines) for k, v in self.cpu_s.items()}


def write_batches(work: Path, lines: int, batches: int, max_tokens: int) -> list[Path]:
    bodies = chat_bodies(lines, max_tokens, seed=7)
    paths = []
    per = -(-lines // batches)
    for b in range(batches):
        path = work / f"fleet-{b}.jsonl"
        with path.open("w") as out:
            for i, body in enumerate(bodies[b * per : (b + 1) * per]):
                line = request_line(f"b{b}-r{i}", {"model": MODEL, **body})
                out.write(json.dumps(line) + "\n")
        paths.append(path)
    return paths


def _progress(url: str, batch_ids: list[str]) -> tuple[int, int, list[str], int]:
    """(lines committed, output tokens, the batches' statuses, the database's connections)."""
    import psycopg

    conninfo = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_completed + request_failed, output_tokens, status FROM batches "
            "WHERE id = ANY(%s)",
            (batch_ids,),
        ).fetchall()
        connections = conn.execute(
            "SELECT count(*) - 1 FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
    lines, tokens = sum(r[0] for r in rows), sum(r[1] or 0 for r in rows)
    return lines, tokens, [r[2] for r in rows], int(connections[0] if connections else 0)


def _commit_lags(broker_url: str, batch_ids: list[str]) -> list[float]:
    from celery import Celery

    app = Celery(broker=broker_url)
    try:
        replies = app.control.broadcast(
            "request_timings", arguments={"batch_ids": batch_ids}, reply=True, timeout=5.0
        )
    finally:
        app.close()
    lags: list[float] = []
    for reply in replies:
        for answer in reply.values():
            lags.extend(answer.get("commit_lags", []) if isinstance(answer, dict) else [])
    return lags


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def steady_rate(samples: list[Sample], total: int, attr: str = "lines") -> float:
    """Per second over the middle 80% of ``total`` lines (interpolated between samples)."""

    def when(target: float) -> float:
        prev = samples[0]
        for s in samples:
            if s.lines >= target:
                if s.lines == prev.lines:
                    return s.t
                return prev.t + (s.t - prev.t) * (target - prev.lines) / (s.lines - prev.lines)
            prev = s
        return samples[-1].t

    lo, hi = 0.1 * total, 0.9 * total
    t0, t1 = when(lo), when(hi)
    if t1 <= t0:
        return 0.0
    if attr == "lines":
        return (hi - lo) / (t1 - t0)

    # tokens: read the token counts at the same two instants
    def value_at(t: float) -> float:
        prev = samples[0]
        for s in samples:
            if s.t >= t:
                span = s.t - prev.t
                frac = 0.0 if span <= 0 else (t - prev.t) / span
                return prev.tokens + frac * (s.tokens - prev.tokens)
            prev = s
        return samples[-1].tokens

    return (value_at(t1) - value_at(t0)) / (t1 - t0)


def run_fleet(args: argparse.Namespace, workers: int, tree: Path = REPO) -> Result:
    """One fleet size on a fresh stack run from ``tree`` (this repository, or a worktree)."""
    work = Path(tempfile.mkdtemp(prefix=f"batchd-fleet-{workers}-"))
    pg: PrivatePostgres | None = None
    db: Database | None = None
    broker = None
    stack: Procs | None = None
    try:
        try:
            pg = PrivatePostgres(work)
            db = Database(pg.admin_url, migrate=tree)
        except Exception as exc:  # no initdb here: the shared server, statements not counted
            print(f"  (private Postgres unavailable: {exc}; using the shared server)")
            pg = None
            db = Database(migrate=tree)
        if pg is not None:
            pg.sql(f"GRANT pg_read_all_data TO {BENCH_ROLE}")
        broker = Broker(work)
        env = service_env(
            work, db.url, broker.url,
            BATCHD_MODELS=json.dumps({MODEL: f"sim:{args.sim}"}),
            BATCHD_SHARD_MAX_REQUESTS=str(args.shard_requests),
            BATCHD_WORKER_SHARD_CONCURRENCY=str(args.shard_concurrency),
            BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT=str(10**12),
            # Enough shards on the queue to keep every worker's shard slots busy.
            BATCHD_MAX_RELEASED_SHARDS_PER_MODEL=str(2 * workers * args.shard_concurrency),
        )  # fmt: skip
        port = free_port()
        stack = Procs(work, cwd=tree)
        stack.start("api", api_command(port), env)
        # The processes as ``python -m worker`` (and so ``batchd up`` and compose) start them.
        stack.start("control", worker_module_command("control", extra=QUIET), env)
        stack.start("beat", worker_module_command("beat", extra=["--loglevel", "INFO"]), env)
        for i in range(workers):
            stack.start(f"model{i}", worker_module_command("model", [MODEL], extra=QUIET), env)

        def ready() -> bool:
            stack.check_alive()
            if not api_up(port) or "ready." not in stack.log("control"):
                return False
            return all(f"model {MODEL} ready" in stack.log(f"model{i}") for i in range(workers))

        wait_for(ready, 300, "the fleet to start", stack.logs)
        from openai import OpenAI

        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key=BENCH_API_KEY,
            max_retries=2,
            timeout=120,
        )
        paths = write_batches(work, args.lines, args.batches, args.max_tokens)
        files = []
        for path in paths:
            with path.open("rb") as fh:
                files.append(client.files.create(file=(path.name, fh), purpose="batch").id)
        if pg is not None:
            pg.reset_statements()
            base_statements = pg.statements(db.name)
        meter = CpuMeter()
        groups = lambda: {  # noqa: E731
            **{name: [pid] for name, pid in stack.pids().items()},
            **({"postgres": pg.pids()} if pg is not None else {}),
            **({"redis": [broker.pid]} if broker.pid else {}),
        }
        meter.sample(groups())
        cpu0 = meter.totals()
        t0 = time.monotonic()
        batch_ids = [
            client.batches.create(input_file_id=f, endpoint="/v1/chat/completions",
                                  completion_window="24h").id
            for f in files
        ]  # fmt: skip
        bench_url = db.url.replace("postgres@", f"{BENCH_ROLE}@") if pg is not None else db.url
        samples: list[Sample] = [Sample(0.0, 0, 0)]
        peak_connections = 0
        deadline = t0 + args.timeout
        while True:
            time.sleep(0.5)
            lines, tokens, statuses, connections = _progress(bench_url, batch_ids)
            peak_connections = max(peak_connections, connections)
            meter.sample(groups())
            samples.append(Sample(time.monotonic() - t0, lines, tokens))
            if all(s in ("completed", "failed", "expired", "cancelled") for s in statuses):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{workers} workers: {lines} of {args.lines} after {args.timeout} s"
                )
            stack.check_alive()
        wall = time.monotonic() - t0
        if any(s != "completed" for s in statuses):
            raise RuntimeError(f"batches ended {statuses}\n{stack.logs()}")
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in meter.totals().items()}
        statements = transactions = None
        top: list[tuple[int, str]] = []
        if pg is not None:
            top = pg.top_statements(db.name)
            calls, xacts = pg.statements(db.name)
            statements = (calls - base_statements[0]) / args.lines
            transactions = (xacts - base_statements[1]) / args.lines
        lags = _commit_lags(broker.url, batch_ids)
        busiest = max(cpu, key=lambda k: cpu[k])
        total_cpu = sum(cpu.values())
        saturated = (
            f"{busiest} ({100 * cpu[busiest] / wall:.0f}% of a core; all processes "
            f"{100 * total_cpu / wall / (os.cpu_count() or 1):.0f}% of the machine)"
        )
        return Result(
            workers=workers,
            lines=args.lines,
            lines_per_s=steady_rate(samples, args.lines),
            tokens_per_s=steady_rate(samples, args.lines, "tokens"),
            lag_p50_ms=None if not lags else 1000 * (_quantile(lags, 0.5) or 0),
            lag_p99_ms=None if not lags else 1000 * (_quantile(lags, 0.99) or 0),
            wall_s=wall,
            cpu_s=cpu,
            statements_per_line=statements,
            transactions_per_line=transactions,
            saturated=saturated,
            peak_connections=peak_connections,
            top_statements=top,
            samples=samples,
        )
    finally:
        if stack is not None:
            stack.stop_all()
        if broker is not None:
            broker.stop()
        if db is not None:
            db.drop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(work, ignore_errors=True)


# -- report


def _group(name: str) -> str:
    return "model" if name.startswith("model") else name


def table(results: list[Result]) -> str:
    rows = [
        "workers  lines/s  tokens/s  lag p50 ms  lag p99 ms  stmts/line  xacts/line  "
        "CPU ms/line: api control beat model(all) postgres redis"
    ]
    for r in results:
        per = {}
        for k, v in r.cpu_ms_per_line().items():
            per[_group(k)] = per.get(_group(k), 0.0) + v
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        cpu = " ".join(
            f"{per.get(k, 0.0):.2f}"
            for k in ("api", "control", "beat", "model", "postgres", "redis")
        )
        rows.append(
            f"{r.workers:>7}  {r.lines_per_s:7.0f}  {r.tokens_per_s:8.0f}  {fmt(r.lag_p50_ms):>10}"
            f"  {fmt(r.lag_p99_ms):>10}  {fmt(r.statements_per_line):>10}  "
            f"{fmt(r.transactions_per_line):>10}  {cpu}"
        )
    rows.append("")
    rows.extend(
        f"{r.workers} workers: busiest {r.saturated}; {r.peak_connections} database "
        "connections at the peak"
        for r in results
    )
    last = results[-1]
    if last.top_statements:
        rows.append(f"\nstatements per line at {last.workers} workers, most frequent first:")
        rows.extend(f"  {calls / last.lines:7.3f}  {query}" for calls, query in last.top_statements)
    return "\n".join(rows)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.workers for r in results], [r.lines_per_s for r in results], marker="o")
    ax.set_xlabel("sim model workers")
    ax.set_ylabel("result lines committed per second")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.workers for r in results], [str(r.workers) for r in results])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title("batchd control plane: lines/s against workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8", help="fleet sizes, comma-separated")
    parser.add_argument("--lines", type=int, default=20_000, help="request lines per run")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sim", default=DEFAULT_SIM, help="the sim model's options")
    parser.add_argument("--shard-requests", type=int, default=500)
    parser.add_argument("--shard-concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per fleet size")
    parser.add_argument("--out", type=Path, default=None, help="directory for fleet.json/.png")
    parser.add_argument(
        "--base", default=None, help="also run this revision (a git worktree), size by size"
    )
    args = parser.parse_args(argv)
    results, base_results = [], []
    with tempfile.TemporaryDirectory(prefix="batchd-fleet-base-") as tmp:
        base = worktree(args.base, Path(tmp) / "base") if args.base else None
        try:
            for n in (int(x) for x in args.workers.split(",")):
                trees = [("this tree", REPO, results)]
                if base is not None:
                    trees.append((args.base, base, base_results))
                for label, tree, out in trees:
                    print(f"{label}, {n} model workers: {args.lines} lines …", flush=True)
                    r = run_fleet(args, n, tree)
                    print(f"  {r.lines_per_s:.0f} lines/s, {r.wall_s:.1f} s", flush=True)
                    out.append(r)
        finally:
            if base is not None:
                remove_worktree(base)
    print()
    print(table(results))
    if base_results:
        print(f"\n{args.base}:\n{table(base_results)}\n\nthis tree / {args.base}:")
        for r, b in zip(results, base_results, strict=True):
            cpu = sum(r.cpu_ms_per_line().values()) / max(1e-9, sum(b.cpu_ms_per_line().values()))
            print(
                f"  {r.workers} workers: lines/s {r.lines_per_s / max(b.lines_per_s, 1e-9):.2f}x,"
                f" CPU per line {cpu:.2f}x"
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "base_results": [
                {**{k: v for k, v in r.__dict__.items() if k != "samples"},
                 "cpu_ms_per_line": r.cpu_ms_per_line()}
                for r in base_results
            ],  # fmt: skip
            "results": [
                {**{k: v for k, v in r.__dict__.items() if k != "samples"},
                 "cpu_ms_per_line": r.cpu_ms_per_line(),
                 "samples": [s.__dict__ for s in r.samples]}
                for r in results
            ],
        }  # fmt: skip
        (args.out / "fleet.json").write_text(json.dumps(data, indent=1))
        plot(results, args.out / "fleet.png")
        print(f"\nwrote {args.out / 'fleet.json'} and {args.out / 'fleet.png'}")
    print(f"\n(statistics: median lines/s {statistics.median(r.lines_per_s for r in results):.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
