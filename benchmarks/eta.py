"""How accurate are the projected completions? ``python -m benchmarks.eta``

The whole service runs on the demo model (a fresh Postgres database, a private redis-server,
the API, a control worker, a model worker and beat). Two tenants keep a steady mixed load
on it (batches of different sizes and output lengths, a new one whenever one ends); once the
load has run a while, a third tenant asks for an estimate of its job, submits it, and the
benchmark reads the job's ``estimated_completion_at`` as it runs. Printed: the prediction
before submitting (``POST /v1/batches/estimate``) and at 10%, 50% and 90% progress against
the actual completion, as the error over the time that was still to go when the prediction
was made and over the job's whole duration (target: within 20% at 50%); then the error at
every 10% of progress, and the job's and all tenants' rates by quarter of its run (what moved
the projection). The JSON record at ``--out`` holds the curve (``curve``: every projection
read while the job ran, against the actual completion) and the raw samples behind it
(``series``, ``lines``, ``shards``: see :mod:`benchmarks.eta_record`). Nothing here imports
``tests``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.eta_record import Recorder, curve, phases
from cli.perf.service import Procs, api_up, free_port, wait_for
from cli.perf.workload import LengthDist, chat_bodies, request_line
from core.launch import QUIET, beat_command, control_worker_command, model_worker_command
from testkit.bench.revisions import REPO
from testkit.service.soak_stack import create_key
from testkit.service.stack import MODEL, Database, RedisServer, api_command

MARKS = (0.10, 0.50, 0.90)


def job_lines(prefix: str, n: int, rng: random.Random, tokens: tuple[int, int]) -> bytes:
    """``n`` chat requests of 3 to 24 filler words, each generating exactly a number of tokens
    drawn from ``tokens`` (``ignore_eos``): ``cli.perf.workload.chat_bodies``."""
    bodies = chat_bodies(
        n,
        LengthDist("uniform", *tokens),
        rng.getrandbits(32),
        words=LengthDist("uniform", 3, 24),
        model=MODEL,
    )
    rows = [
        request_line(f"{prefix}-{i}", {**body, "temperature": 0, "ignore_eos": True})
        for i, body in enumerate(bodies)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class Client:
    def __init__(self, url: str, key: str):
        import httpx

        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def upload(self, data: bytes) -> str:
        r = self.http.post(
            "/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", data, "application/jsonl")},
        )
        r.raise_for_status()
        return r.json()["id"]

    def body(self, file_id: str) -> dict[str, Any]:
        return {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }

    def create(self, file_id: str) -> dict[str, Any]:
        r = self.http.post("/batches", json=self.body(file_id))
        r.raise_for_status()
        return r.json()

    def estimate(self, file_id: str) -> dict[str, Any]:
        r = self.http.post("/batches/estimate", json=self.body(file_id))
        r.raise_for_status()
        return r.json()

    def get(self, batch_id: str) -> dict[str, Any]:
        r = self.http.get(f"/batches/{batch_id}")
        r.raise_for_status()
        return r.json()


def ended(batch: dict[str, Any]) -> bool:
    return batch["status"] in ("completed", "failed", "expired", "cancelled")


class Load(threading.Thread):
    """Keeps ``in_flight`` batches of one tenant running until stopped."""

    def __init__(self, client: Client, name: str, size: int, tokens: tuple[int, int], seed: int):
        super().__init__(daemon=True, name=f"load-{name}")
        self.client, self.name, self.size, self.tokens = client, name, size, tokens
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done = 0

    def run(self) -> None:
        running: list[str] = []
        k = 0
        while not self.stop.is_set():
            while len(running) < 2:
                data = job_lines(f"{self.name}{k}", self.size, self.rng, self.tokens)
                running.append(self.client.create(self.client.upload(data))["id"])
                k += 1
            still = []
            for batch_id in running:
                if ended(self.client.get(batch_id)):
                    self.done += 1
                else:
                    still.append(batch_id)
            running = still
            self.stop.wait(0.5)


def start_stack(root: Path, database_url: str, redis_url: str) -> tuple[Procs, dict, int]:
    import os

    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_BROKER_URL": redis_url,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",
        "BATCHD_SHARD_MAX_REQUESTS": "50",
        "BATCHD_WORKER_SHARD_CONCURRENCY": "4",
        "BATCHD_MAX_RELEASED_SHARDS_PER_MODEL": "4",
        "BATCHD_RELEASE_SWEEP_INTERVAL_S": "1",
        "BATCHD_CHECKPOINT_EVERY": "16",
        "BATCHD_CHECKPOINT_INTERVAL_S": "1",
        "BATCHD_ETA_REFRESH_INTERVAL_S": "1",
        "BATCHD_ENGINE_OPTIONS": json.dumps({"max_num_seqs": 32}),
    }
    (root / "home").mkdir(parents=True, exist_ok=True)
    procs = Procs(root, cwd=REPO)
    port = free_port()
    procs.start("api", api_command(port), env)
    procs.start("control", control_worker_command("control@eta", extra=QUIET), env)
    procs.start("model", model_worker_command([MODEL], 4, "model@eta", extra=QUIET), env)
    procs.start("beat", beat_command(root / "beat-schedule"), env)

    def ready() -> bool:
        procs.check_alive()
        return (
            api_up(port)
            and "ready." in procs.log("control")
            and f"model {MODEL} ready" in procs.log("model")
        )

    wait_for(ready, 180, "the service", procs.logs)
    return procs, env, port


def measure(args: argparse.Namespace, url: str, env: dict[str, str]) -> dict[str, Any]:
    keys = {t: create_key(t, env).key for t in ("tenant-a", "tenant-b", "tenant-c")}
    clients = {t: Client(url, k) for t, k in keys.items()}
    loads = [
        Load(clients["tenant-b"], "b", 150, (4, 12), 1),
        Load(clients["tenant-c"], "c", 60, (16, 32), 2),
    ]
    for load in loads:
        load.start()
    time.sleep(args.warmup)
    rng = random.Random(3)
    data = job_lines("job", args.lines, rng, (4, 24))
    max_tokens = {
        row["custom_id"]: row["body"]["max_tokens"] for row in map(json.loads, data.splitlines())
    }
    file_id = clients["tenant-a"].upload(data)
    estimate = clients["tenant-a"].estimate(file_id)
    job = clients["tenant-a"].create(file_id)
    recorder = Recorder(env["BATCHD_DATABASE_URL"], clients["tenant-a"], job["id"],
                        float(job["created_at"]))  # fmt: skip
    marks: dict[float, dict[str, Any]] = {}
    seen = []
    try:
        while True:
            b = clients["tenant-a"].get(job["id"])
            t = time.time()
            recorder.sample(b, t)
            counts = b["request_counts"]
            progress = (counts["completed"] + counts["failed"]) / max(1, counts["total"] or 1)
            if b["status"] == "in_progress":
                seen.append((t, progress, b.get("estimated_completion_at")))
                for mark in MARKS:
                    if mark not in marks and progress >= mark and b.get("estimated_completion_at"):
                        marks[mark] = {"at": t, "progress": progress,
                                       "predicted": b["estimated_completion_at"]}  # fmt: skip
            if ended(b):
                break
            time.sleep(0.5)
        shards = recorder.shards()
    finally:
        recorder.close()
        for load in loads:
            load.stop.set()
    actual = float(b["completed_at"] or b["finalizing_at"] or time.time())
    created = float(b["created_at"])
    rows = []
    before = estimate.get("estimated_completion_at")
    if before is not None:
        rows.append(("before submit", created, float(before)))
    for mark in MARKS:
        if mark in marks:
            rows.append((f"{int(mark * 100)}%", marks[mark]["at"], float(marks[mark]["predicted"])))
    results = []
    for name, at, predicted in rows:
        to_go = max(1e-9, actual - at)
        results.append({
            "when": name,
            "predicted_minus_actual_s": predicted - actual,
            "error_of_time_to_go": (predicted - actual) / to_go,
            "error_of_duration": (predicted - actual) / max(1e-9, actual - created),
        })  # fmt: skip
    return {
        "job": {"lines": args.lines, "status": b["status"], "duration_s": actual - created},
        # Times in seconds from the job's creation (see benchmarks.eta_record).
        "curve": curve(recorder.series, actual - created),
        "phases": phases(recorder.series, "tenant-a"),
        "estimate_before_submit": estimate,
        "marks": results,
        "load_batches_done": {load.name: load.done for load in loads},
        "samples": len(seen),
        "series": recorder.series,
        "lines": recorder.lines,
        "shards": shards,
        "job_max_tokens": max_tokens,
    }


DECILES = tuple(f"{10 * k}%" for k in range(1, 10))


def decile(points: list[dict[str, Any]], mark: str) -> float | None:
    """The error of duration of the first projection at or past ``mark`` progress."""
    share = float(mark.rstrip("%")) / 100
    return next((p["error_of_duration"] for p in points if p["progress"] >= share), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    ap.add_argument(
        "--lines", type=int, default=15000, help="lines of the measured job (about 250 s here)"
    )
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the job")
    ap.add_argument("--out", type=Path, default=Path("eta-benchmark.json"))
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is needed (a private one is started on a free port)")
    root = Path(tempfile.mkdtemp(prefix="batchd-eta-"))
    db = Database(args.pg_admin_url, prefix="batchd_soak")
    redis = RedisServer(root, fallback_url="")  # never used: the binary is there
    procs = None
    try:
        procs, env, port = start_stack(root, db.url, redis.url)
        record = measure(args, f"http://127.0.0.1:{port}/v1", env)
    finally:
        if procs is not None:
            procs.stop_all()
        redis.stop()
        db.drop()
    args.out.write_text(json.dumps(record, indent=2))
    job = record["job"]
    print(f"job: {job['lines']} lines, {job['status']} in {job['duration_s']:.1f} s "
          f"beside load batches done {record['load_batches_done']}")  # fmt: skip
    print(f"{'when':>14}  {'pred - actual':>13}  {'err/time to go':>14}  {'err/duration':>12}")
    for m in record["marks"]:
        print(f"{m['when']:>14}  {m['predicted_minus_actual_s']:>12.1f}s  "
              f"{100 * m['error_of_time_to_go']:>13.1f}%  {100 * m['error_of_duration']:>11.1f}%")  # fmt: skip
    print("projected minus actual completion, as a share of the job's duration, by progress:")
    print("  " + "  ".join(f"{p:>5}" for p in DECILES))
    print("  " + "  ".join(f"{100 * e:>+4.0f}%" if e is not None else "    -" for e in
                           (decile(record["curve"], p) for p in DECILES)))  # fmt: skip
    print("by quarter of the run: the job's and all tenants' estimated tokens/s, share, load")
    for ph in record["phases"]:
        print(f"  {ph['from_s']:>6.0f}-{ph['to_s']:<6.0f}s  job {ph['job_tokens_per_s']:>6.0f}/s  "
              f"all {ph['all_tokens_per_s']:>6.0f}/s  share {ph['job_share']}  "
              f"load {ph['loadavg_1m']}")  # fmt: skip
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
