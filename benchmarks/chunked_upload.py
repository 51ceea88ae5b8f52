"""A file of ``--gib`` GiB (default 1) through the Uploads API, as the ``openai`` SDK sends it
(``client.uploads.upload_file_chunked``, 64 MiB parts), against the API alone on a fresh
Postgres database and a private Redis: the seconds it takes, the rate, and how much the API
process's peak resident memory (``VmHWM``) grew, which must stay far below one part.

    .venv/bin/python -m benchmarks.chunked_upload
    .venv/bin/python -m benchmarks.chunked_upload --gib 0.25   # a quicker look

The file is sparse (written with ``truncate``), so the disk holds the stored copy only.
Exit status 1 when the API's peak memory grew by ``--max-growth-mib`` or more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from cli.perf.service import memory_kb
from testkit.service import stack as bs

MiB = 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--part-mib", type=int, default=64)
    p.add_argument("--max-growth-mib", type=float, default=32.0)
    p.add_argument("--pg-admin-url", default=bs.PG_ADMIN_URL)
    p.add_argument("--redis-url", default=bs.REDIS_URL, help="without redis-server only")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="batchd-bench-chunked-"))
    size = int(args.gib * 1024**3)
    big = work / "big.bin"
    with big.open("wb") as out:
        out.truncate(size)
    md5 = hashlib.md5()
    for _ in range(size // MiB):
        md5.update(b"\0" * MiB)
    md5.update(b"\0" * (size % MiB))
    with bs.Run(work, args.pg_admin_url, args.redis_url) as run:
        stack = run.stack(run.env()).start_roles(("api",))
        stack.wait_ready()
        pid = stack.procs["api"].pid
        client = stack.client(timeout=600)
        client.uploads.upload_file_chunked(  # warm-up: first-use imports and caches
            file=b"x", filename="w", bytes=1, mime_type="text/plain", purpose="batch"
        )
        base = memory_kb(pid)
        start = time.monotonic()
        upload = client.uploads.upload_file_chunked(
            file=big,
            mime_type="application/octet-stream",
            purpose="batch",
            part_size=args.part_mib * MiB,
            md5=md5.hexdigest(),
        )
        seconds = time.monotonic() - start
        end = memory_kb(pid)
        stack.check_alive()
    if base is None or end is None:
        raise RuntimeError("the API process is gone")
    growth_mib = (end[1] - base[1]) / 1024
    result = {
        "bytes": size,
        "part_bytes": args.part_mib * MiB,
        "status": upload.status,
        "seconds": round(seconds, 2),
        "mib_per_s": round(size / MiB / seconds, 1),
        "api_vmhwm_before_mib": round(base[1] / 1024, 1),
        "api_vmhwm_growth_mib": round(growth_mib, 1),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if upload.status == "completed" and growth_mib < args.max_growth_mib else 1


if __name__ == "__main__":
    sys.exit(main())
