"""Finalize at 10k, 50k and 200k lines: time per line and peak memory, each in a fresh process.

    python -m benchmarks.finalize_scale
    python -m benchmarks.finalize_scale --sizes 10000,50000,200000 --json finalize.json

``worker.batches.finalize`` merges a batch's checkpoint chunks into its output and error files and
promises to do it with bounded memory, so its time should grow with the lines and its memory
not at all. Each job is built as it stands right before its finalize, on a fresh Postgres
database (``testkit.service.stack.Database``) and a local storage directory: the input file
(chat requests), a ``finalizing`` batch row, one ``done`` shard row per ``--shard-lines``
lines, and each shard's committed checkpoint chunks of ``--checkpoint-every`` results (chat
completions of about 700 bytes, ``--error-share`` of them error lines), written and logged in
the results log as a shard does it: the lines of a shard finish out of order, so each chunk
holds a scattered, sorted set of the shard's lines and the merge interleaves them all.

Each size's finalize then runs in a fresh ``python`` process (the real
``worker.batches.finalize.finalize``, as the control worker calls it). Reported per size: wall
seconds, CPU seconds (``getrusage``), microseconds per line, the process's resident memory
before the finalize and its peak during it (``VmRSS`` and ``VmHWM`` of /proc, ``ru_maxrss``),
and the two verdicts: the per-line time of the largest size over the smallest's (1.0 is
linear) and the growth of the finalize's peak memory from the smallest size to the largest
(flat is a few MB of allocator noise).

``--unfinished 0.5`` measures the finalize of a cancel instead: ``cancelling`` batches whose
shards stopped with half their lines never run, each of which gets a ``batch_cancelled`` line
(read back from the input file) in the error file and in the finalize's results-log chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from cli.perf import workload
from testkit.bench.revisions import REPO, run_json

# The finalize in a fresh process: the batch id on stdin, one JSON line of measurements out.
_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
job = json.load(sys.stdin)
def status_kb(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
from worker.batches.finalize import finalize
from core.database.sessions import session_scope
from sqlalchemy import text
with session_scope() as session:  # connect first: the pool is not the finalize's cost
    session.execute(text("select 1"))
rss0, hwm0 = status_kb("VmRSS"), status_kb("VmHWM")
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
status = finalize(job["batch_id"])
wall = time.perf_counter() - t0
ru1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
print(json.dumps({"status": status, "wall_s": wall, "cpu_s": cpu, "rss_before_kb": rss0,
                  "hwm_before_kb": hwm0, "hwm_kb": status_kb("VmHWM"),
                  "ru_maxrss_kb": ru1.ru_maxrss}))
"""

WORDS = (
    "the batch service keeps every accelerator busy while clients wait for results and each "
    "request finishes in its own time so the output is merged back in input order"
).split()


def request_line(line: int, model: str, rng: random.Random) -> bytes:
    """A chat request of the input file (about 250 bytes)."""
    prompt = " ".join(rng.choices(WORDS, k=20))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 128,
    }
    obj = workload.request_line(f"req-{line:07d}", body)
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def result_record(line: int, model: str, ok: bool, rng: random.Random) -> dict[str, Any]:
    """The output line of a chat request with a short reply (about 700 bytes, half of them
    the ids and the usage block), or its error line."""
    from core.batchfile.results import (
        ChoiceResult,
        GenerationResult,
        output_line,
        request_error_line,
        usage_dict,
    )

    custom_id = f"req-{line:07d}"
    if not ok:
        return request_error_line(
            custom_id,
            message=f"line {line}: the prompt is 9000 tokens, over the model's 8192",
            code="context_length_exceeded",
            param="messages",
        )
    text = " ".join(rng.choices(WORDS, k=8))
    result = GenerationResult(
        prompt_tokens=rng.randint(20, 40),
        cached_tokens=0,
        choices=[ChoiceResult(0, text, "stop", rng.randint(30, 60))],
    )
    body = {
        "id": f"chatcmpl-{rng.getrandbits(96):024x}",
        "object": "chat.completion",
        "created": 1_750_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage_dict(result),
        "system_fingerprint": None,
    }
    return output_line(custom_id, body)


def build_job(
    database_url: str, storage_root: Path, lines: int, args: argparse.Namespace
) -> tuple[str, int]:
    """A ``finalizing`` batch of ``lines`` requests with every shard done and its chunks
    committed and logged; returns (its id, how many of its lines are error lines). With
    ``args.unfinished``, a ``cancelling`` batch instead, each shard stopped with that share
    of its lines (its last chunks' worth) never run."""
    from core.batches import ids
    from core.database.lifecycle import BatchStatus, ShardStatus, now
    from core.database.results_log import ChunkRecord, log_chunk, write_chunk
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File, Shard
    from core.storage.local import LocalStorage
    from worker.shards.checkpoints import chunk_key

    rng = random.Random(lines)
    sto = LocalStorage(storage_root)
    model = "demo"
    file_id, batch_id = ids.file_id(), ids.batch_id()
    key = f"files/{file_id}"
    offsets = [0]
    with sto.writer(key) as out:
        for line in range(1, lines + 1):
            data = request_line(line, model, rng)
            out.write(data)
            offsets.append(offsets[-1] + len(data))
    created = now()
    errors = 0
    cancel = args.unfinished > 0
    status = BatchStatus.CANCELLING if cancel else BatchStatus.FINALIZING
    with session_scope(database_url) as session:
        session.add(File(id=file_id, tenant="default", purpose="batch",
                         filename=f"{lines}.jsonl", bytes=offsets[-1], storage_key=key,
                         created_at=created, expires_at=created + timedelta(days=30)))  # fmt: skip
        session.add(Batch(id=batch_id, tenant="default", endpoint="/v1/chat/completions",
                          model=model, input_file_id=file_id, completion_window="24h",
                          status=status, created_at=created,
                          expires_at=created + timedelta(hours=24), in_progress_at=created,
                          finalizing_at=created, request_total=lines,
                          validation_done=True, validated_at=created))  # fmt: skip
    for index, start in enumerate(range(1, lines + 1, args.shard_lines)):
        end = min(start + args.shard_lines, lines + 1)
        order = list(range(start, end))
        rng.shuffle(order)  # the order the shard's requests finished in
        every = args.checkpoint_every
        groups = [order[i : i + every] for i in range(0, len(order), every)]
        never_ran = groups[len(groups) - round(len(groups) * args.unfinished) :] if cancel else []
        groups = groups[: len(groups) - len(never_ran)]
        errors += sum(map(len, never_ran))  # each gets a batch_cancelled line
        logged: list[tuple[str, list[str | None]]] = []
        for c, group in enumerate(groups):
            records = []
            for line in group:
                ok = rng.random() >= args.error_share
                errors += not ok
                records.append(ChunkRecord(line, ok, result_record(line, model, ok, rng)))
            ckey = chunk_key(batch_id, index, c)
            logged.append((ckey, write_chunk(sto, ckey, records)))
        with session_scope(database_url) as session:
            done = sum(map(len, groups))
            session.add(Shard(batch_id=batch_id, index=index,
                              status=ShardStatus.STOPPED if cancel else ShardStatus.DONE,
                              start_line=start, end_line=end, start_offset=offsets[start - 1],
                              end_offset=offsets[end - 1], num_requests=end - start,
                              done_requests=done, num_chunks=len(groups),
                              attempts=1))  # fmt: skip
            session.flush()
            for ckey, line_ids in logged:
                log_chunk(session, batch_id, ckey, line_ids)
    return batch_id, errors


def run_finalize(batch_id: str, env: dict[str, str]) -> dict[str, Any]:
    return run_json(
        _CHILD, {"batch_id": batch_id}, f"the finalize of {batch_id}", cwd=REPO, env=env
    )


def check_files(database_url: str, storage_root: Path, batch_id: str, lines: int,
                errors: int, want: str) -> float:  # fmt: skip
    """The batch completed with every line in its output or error file, in input order;
    returns the output file's mean line size in bytes."""
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File

    with session_scope(database_url) as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        if batch.status != want:
            raise RuntimeError(f"{batch_id} ended {batch.status}, not {want}")
        counts = {}
        for name, file_id, expected in (
            ("output", batch.output_file_id, lines - errors),
            ("error", batch.error_file_id, errors),
        ):
            row = session.get(File, file_id) if file_id else None
            previous, counts[name] = 0, 0
            if row is not None:
                with (storage_root / row.storage_key).open("rb") as fh:
                    for raw in fh:
                        number = int(json.loads(raw)["custom_id"].removeprefix("req-"))
                        if number <= previous:
                            raise RuntimeError(f"{name} file of {batch_id}: line {number} "
                                               f"after line {previous}")  # fmt: skip
                        previous = number
                        counts[name] += 1
            if counts[name] != expected:
                raise RuntimeError(
                    f"{name} file of {batch_id}: {counts[name]} lines, expected {expected}"
                )
        output = session.get(File, batch.output_file_id)
        return output.bytes / max(1, counts["output"]) if output is not None else 0.0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.finalize_scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="10000,50000,200000", help="lines per job")
    parser.add_argument("--shard-lines", type=int, default=2000, help="lines per shard (2000)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=64, help="results per checkpoint chunk (64)"
    )
    parser.add_argument("--error-share", type=float, default=0.02, help="error lines (0.02)")
    parser.add_argument(
        "--unfinished",
        type=float,
        default=0.0,
        help="cancelled jobs instead, this share of each shard's lines never run (0: none)",
    )
    parser.add_argument(
        "--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from testkit.service.stack import Database

    db = Database(args.pg_admin_url, prefix="batchd_finalize")
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="batchd-finalize-") as tmp:
            storage_root = Path(tmp) / "storage"
            env = {
                **os.environ,
                "BATCHD_HOME": str(Path(tmp) / "home"),
                "BATCHD_DATABASE_URL": db.url,
                "BATCHD_STORAGE_URL": str(storage_root),
                "BATCHD_BROKER_URL": "memory://",
                # The jobs are built past the default cap of lines per batch.
                "BATCHD_MAX_REQUESTS_PER_BATCH": str(max(sizes)),
            }
            for lines in sizes:
                t0 = time.perf_counter()
                batch_id, errors = build_job(db.url, storage_root, lines, args)
                built_s = time.perf_counter() - t0
                figures = run_finalize(batch_id, env)
                want = "cancelled" if args.unfinished else "completed"
                line_bytes = check_files(db.url, storage_root, batch_id, lines, errors, want)
                figures.update(lines=lines, error_lines=errors, build_s=built_s,
                               output_line_bytes=line_bytes,
                               us_per_line=figures["wall_s"] / lines * 1e6,
                               cpu_us_per_line=figures["cpu_s"] / lines * 1e6,
                               peak_growth_mb=(figures["hwm_kb"] - figures["rss_before_kb"]) / 1024)  # fmt: skip
                results.append(figures)
                print(
                    f"{lines:>7} lines: finalize {figures['wall_s']:.2f} s wall, "
                    f"{figures['cpu_s']:.2f} s CPU, {figures['us_per_line']:.1f} us/line "
                    f"({figures['cpu_us_per_line']:.1f} CPU us/line); RSS "
                    f"{figures['rss_before_kb'] / 1024:.0f} MB before, peak "
                    f"{figures['hwm_kb'] / 1024:.0f} MB (+{figures['peak_growth_mb']:.1f} MB); "
                    f"{errors} error lines, output lines of {line_bytes:.0f} bytes; "
                    f"built in {built_s:.1f} s",
                    flush=True,
                )
    finally:
        db.drop()
    small, large = results[0], results[-1]
    report = {
        "sizes": results,
        "per_line_ratio_wall": large["us_per_line"] / small["us_per_line"],
        "per_line_ratio_cpu": large["cpu_us_per_line"] / small["cpu_us_per_line"],
        "peak_growth_delta_mb": large["peak_growth_mb"] - small["peak_growth_mb"],
    }
    print(
        f"per-line time {large['lines']} / {small['lines']} lines: "
        f"{report['per_line_ratio_wall']:.2f}x wall, {report['per_line_ratio_cpu']:.2f}x CPU "
        f"(1.0 = linear); finalize peak memory {small['peak_growth_mb']:.1f} MB -> "
        f"{large['peak_growth_mb']:.1f} MB above the process's start"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
