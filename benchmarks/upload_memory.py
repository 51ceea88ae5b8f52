"""Resident memory of the API and the control worker while a ~200 MB batch file uploads.

Resident memory of the API and the control worker while a ~200 MB batch file is uploaded
and validated: each must grow by less than 150 MB.

Writes a valid chat JSONL of ``--requests`` lines (default 50,000, the default per-batch
limit) of about ``--line-bytes`` bytes each (default 4,000: about 200 MB in all, under the
200 MiB upload limit), starts the API (uvicorn) and a control worker on a fresh Postgres
database and a private Redis (no model worker: validation only), warms both with a small
batch (first-use costs: imports, the tokenizer), then samples ``VmRSS`` and ``VmHWM`` from
``/proc/<pid>/status`` of both every ``--interval`` seconds while the big file is uploaded
with the ``openai`` client and the batch is validated (until it leaves ``validating``).

The increase reported is against the resident size after the warm-up: the sampled peak of
``VmRSS``, and ``VmHWM`` at the end (the kernel's own peak, which no sampling interval can
miss; it is the figure checked against the target). The batch stays ``in_progress`` (nobody
runs its shards) and is dropped with the database.

    .venv/bin/python -m benchmarks.upload_memory
    .venv/bin/python -m benchmarks.upload_memory --requests 5000   # a quicker look

Exit status 1 when either process grows by 150 MB or more.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.perf.service import Ticker, memory_kb
from cli.perf.workload import request_line
from testkit.service import stack as bs

TARGET_MB = 150.0
ENDPOINT = "/v1/chat/completions"
WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
]  # fmt: skip


def write_batch(path: Path, n: int, line_bytes: int, seed: int = 0) -> int:
    """``n`` valid chat requests of about ``line_bytes`` bytes each; returns the file size."""
    rng = random.Random(seed)
    pool = " ".join(rng.choice(WORDS) for _ in range(4 * line_bytes))
    with path.open("w") as fh:
        for i in range(n):
            head = request_line(
                f"r{i}",
                {
                    "model": bs.MODEL,
                    "messages": [{"role": "user", "content": ""}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
                ENDPOINT,
            )
            room = max(1, line_bytes - len(json.dumps(head, separators=(",", ":"))) - 1)
            start = rng.randrange(0, len(pool) - room)
            head["body"]["messages"][0]["content"] = pool[start : start + room]
            fh.write(json.dumps(head, separators=(",", ":")) + "\n")
    return path.stat().st_size


class MemorySampler:
    """The highest resident memory (VmRSS, KiB) each process is seen at."""

    def __init__(self, pids: dict[str, int], interval: float):
        self.pids = pids
        self.peak_rss: dict[str, int] = dict.fromkeys(pids, 0)
        self._ticker = Ticker(self._sample, interval)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            mem = memory_kb(pid)
            if mem is not None:
                self.peak_rss[name] = max(self.peak_rss[name], mem[0])

    def start(self) -> MemorySampler:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop(10)


def submit_and_validate(client: Any, path: Path, timeout: float) -> tuple[Any, float, float]:
    """Upload, create, wait until the batch leaves ``validating``: (batch, upload s, validate s)."""
    start = time.monotonic()
    batch, uploaded_at = bs.upload_and_create(client, path, ENDPOINT)
    deadline = time.monotonic() + timeout
    while batch.status == "validating":
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch.id} still validating after {timeout}s")
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    return batch, uploaded_at - start, time.monotonic() - uploaded_at


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--line-bytes", type=int, default=4_000)
    p.add_argument("--interval", type=float, default=0.05, help="RSS sampling interval (s)")
    p.add_argument("--model-preset", default="llama-25m", help="demo model (its tokenizer)")
    p.add_argument("--timeout", type=float, default=1800.0, help="for the validation (s)")
    p.add_argument("--pg-admin-url", default=bs.PG_ADMIN_URL)
    p.add_argument("--redis-url", default=bs.REDIS_URL, help="without redis-server only")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args(argv)

    from core.llms.demo import build

    build(args.model_preset)  # once, before two processes race to build it
    work = Path(tempfile.mkdtemp(prefix="batchd-bench-upload-"))
    big, small = work / "big.jsonl", work / "small.jsonl"
    size = write_batch(big, args.requests, args.line_bytes)
    write_batch(small, 20, args.line_bytes, seed=1)
    with bs.Run(work, args.pg_admin_url, args.redis_url, keep=args.keep) as run:
        env = run.env(
            BATCHD_MODELS=json.dumps({bs.MODEL: f"demo:{args.model_preset}"}),
            BATCHD_MAX_REQUESTS_PER_BATCH=str(max(50_000, args.requests)),
        )
        stack = run.stack(env).start_roles(("api", "control"))
        stack.wait_ready()
        pids = {name: stack.procs[name].pid for name in ("api", "control")}
        started = {name: memory_kb(pid) for name, pid in pids.items()}
        client = stack.client(timeout=args.timeout)
        warm, _, _ = submit_and_validate(client, small, args.timeout)
        if warm.status != "in_progress":
            raise RuntimeError(f"the warm-up batch is {warm.status}: {warm.errors}")
        time.sleep(1.0)
        base = {name: memory_kb(pid) for name, pid in pids.items()}
        sampler = MemorySampler(pids, args.interval).start()
        batch, upload_s, validate_s = submit_and_validate(client, big, args.timeout)
        time.sleep(1.0)
        sampler.stop()
        end = {name: memory_kb(pid) for name, pid in pids.items()}
        stack.check_alive()

    ok = batch.status == "in_progress"
    print(
        f"batch file: {args.requests} chat requests, {size / 1e6:.1f} MB ({size / 2**20:.1f} "
        f"MiB); upload {upload_s:.1f}s, validation {validate_s:.1f}s, batch {batch.status} "
        f"({batch.request_counts.total if batch.request_counts else '?'} requests)"
    )
    print(
        f"{'process':<16} {'start MB':>9} {'base MB':>8} {'peak RSS':>9} {'HWM end':>8} "
        f"{'+RSS MB':>8} {'+HWM MB':>8}  (target < {TARGET_MB:g} MB)"
    )
    results: dict[str, Any] = {
        "requests": args.requests,
        "file_bytes": size,
        "upload_s": upload_s,
        "validate_s": validate_s,
        "status": batch.status,
        "target_mb": TARGET_MB,
        "processes": {},
    }
    for name in pids:
        base_rss = base[name][0] / 1024
        peak = max(sampler.peak_rss[name], end[name][0]) / 1024
        hwm = end[name][1] / 1024
        d_rss, d_hwm = peak - base_rss, hwm - base_rss
        passed = d_hwm < TARGET_MB
        ok = ok and passed
        print(
            f"{name:<16} {started[name][0] / 1024:>9.1f} {base_rss:>8.1f} {peak:>9.1f} "
            f"{hwm:>8.1f} {d_rss:>8.1f} {d_hwm:>8.1f}  {'PASS' if passed else 'FAIL'}"
        )
        results["processes"][name] = {
            "start_rss_mb": started[name][0] / 1024,
            "base_rss_mb": base_rss,
            "peak_rss_mb": peak,
            "end_hwm_mb": hwm,
            "rss_increase_mb": d_rss,
            "hwm_increase_mb": d_hwm,
            "pass": passed,
        }
    print("PASS" if ok else "FAIL")
    results["pass"] = ok
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
