"""Peak memory of ``batchd run`` on a small and a large batch file, side by side.

``batchd run`` streams its input and output, so its peak RSS must not grow with the file: the
target is the large run's peak within 200 MB of the small run's. Both files hold short
completions prompts with ``max_tokens`` 1–2 (``--max-tokens 1`` for 1 only) for the
``llama-tiny`` demo model, so the large one finishes in minutes on a few CPU cores.

    .venv/bin/python -m benchmarks.run_memory                    # 1,000 vs 200,000 lines
    .venv/bin/python -m benchmarks.run_memory --large 20000      # a quicker look

Peak RSS is the child's ``ru_maxrss`` from ``wait4`` (exact), cross-checked with ``VmHWM``
sampled from ``/proc/<pid>/status`` while it runs. Exit status 1 when over the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cli.perf.service import Ticker, memory_kb
from cli.perf.workload import request_line

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_MB = 200.0
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "batch",
    "request",
    "model",
    "token",
]


def write_batch(path: Path, n: int, max_tokens: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 4))
            body = {
                "model": "llama-tiny",
                "prompt": f"{prompt} {i}",
                "max_tokens": 1 if max_tokens == 1 else 1 + i % max_tokens,
                "temperature": 0,
            }
            line = request_line(f"r{i}", body, "/v1/completions")
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


def run_one(batch: Path, model: str, extra: list[str]) -> dict:
    out = batch.with_name(batch.stem + ".out.jsonl")
    cmd = [
        sys.executable, "-m", "cli", "run", str(batch), "-o", str(out), "--model", model,
        "--endpoint", "/v1/completions", "--json", *extra,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampled = {"vm_hwm_kb": 0}

    def sample() -> None:
        mem = memory_kb(proc.pid)
        if mem:
            sampled["vm_hwm_kb"] = max(sampled["vm_hwm_kb"], mem[1])

    sampler = Ticker(sample, 0.2).start()
    stdout_chunks: list[bytes] = []
    stderr_chunks: list[bytes] = []
    readers = [
        threading.Thread(target=lambda: stdout_chunks.append(proc.stdout.read())),
        threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read())),
    ]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop()
    for reader in readers:
        reader.join()
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(b"".join(stderr_chunks).decode(errors="replace")[-3000:])
        raise SystemExit(f"batchd run failed on {batch} (exit {proc.returncode})")
    summary = json.loads(b"".join(stdout_chunks))
    lines = sum(1 for _ in out.open("rb"))
    return {
        "requests": summary["total"],
        "output_lines": lines,
        "wall_s": round(wall, 1),
        "requests_per_s": round(summary["total"] / wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "sampled_vm_hwm_mb": round(sampled["vm_hwm_kb"] / 1024, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--large", type=int, default=200_000)
    parser.add_argument("--max-tokens", type=int, default=2, help="1: every request 1 token")
    parser.add_argument("--model", default=None, help="model dir [default: llama-tiny demo]")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "run_args", nargs=argparse.REMAINDER, help="after --: extra `batchd run` options"
    )
    args = parser.parse_args()
    extra = [a for a in args.run_args if a != "--"] or ["--max-num-seqs", "256"]
    if args.model is None:
        from core.llms.demo import build

        args.model = str(build("llama-tiny"))
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        results = {}
        for label, n in (("small", args.small), ("large", args.large)):
            batch = Path(tmp) / f"{label}.jsonl"
            write_batch(batch, n, args.max_tokens)
            size_mb = batch.stat().st_size / 1e6
            print(f"{label}: {n} lines ({size_mb:.1f} MB) …", flush=True)
            results[label] = run_one(batch, args.model, extra)
            results[label]["input_mb"] = round(size_mb, 1)
            print(f"  {json.dumps(results[label])}", flush=True)
    diff = results["large"]["peak_rss_mb"] - results["small"]["peak_rss_mb"]
    ok = diff <= TARGET_MB
    print(
        f"peak RSS: small {results['small']['peak_rss_mb']} MB, large "
        f"{results['large']['peak_rss_mb']} MB, difference {diff:+.1f} MB "
        f"(target ≤ {TARGET_MB:.0f} MB): {'OK' if ok else 'OVER'}"
    )
    print(json.dumps({"results": results, "difference_mb": round(diff, 1), "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
