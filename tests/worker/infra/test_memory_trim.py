"""Worker processes give freed memory back: the trimmer (worker/infra/memory.py) and the control
worker's allocator (worker/__main__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import worker.__main__ as worker_main
from worker.infra import memory

pytestmark = pytest.mark.skipif(not memory.available(), reason="the C library has no malloc_trim")


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_trim_returns_memory_freed_in_the_middle_of_a_heap() -> None:
    """A thread allocates 80 MiB of 2 KiB blocks and frees all but every 64th: the survivors
    pin the heap, so malloc keeps the free pages between them (RSS stays up) until
    ``trim`` hands them back."""
    held: list[bytes] = []
    measured: dict[str, float] = {}

    def churn() -> None:  # a thread of its own: its own arena, as a worker's pool threads
        blocks = [os.urandom(8) * 256 for _ in range(40_000)]  # 2 KiB each, malloc'd
        measured["full"] = _rss_mib()
        held.extend(blocks[::64])
        del blocks
        measured["freed"] = _rss_mib()
        memory.trim()
        measured["trimmed"] = _rss_mib()

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    assert len(held) == 625
    freed_but_held = measured["freed"] - (measured["full"] - 80)
    assert freed_but_held > 40, measured  # without a trim most of it stays resident
    assert measured["freed"] - measured["trimmed"] > 40, measured


def test_one_trimming_thread_per_process() -> None:
    first = memory.start(interval_s=3600)
    assert first is not None and first.is_alive() and first.daemon
    assert first.name == "batchd-malloc-trim"
    assert memory.start() is first
    assert [t for t in threading.enumerate() if t.name == "batchd-malloc-trim"] == [first]


BURST = """
import os
from worker.infra import memory
def rss():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * 4096 / 2**20
base = rss()
burst = ["x" * 40 + str(i) for i in range(1_000_000)]  # a file's lines, parsed
peak = rss()
kept = burst[::1000]  # a few survivors among them (caches, records kept, ...)
del burst
memory.trim()
print(round(peak - base), round(rss() - base), len(kept))
"""


def _after_burst(pythonmalloc: str | None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    if pythonmalloc:
        env["PYTHONMALLOC"] = pythonmalloc
    out = subprocess.run(
        [sys.executable, "-c", BURST], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_the_control_workers_allocator_gives_a_burst_back() -> None:
    """A burst of small objects with a few survivors: Python's own allocator keeps nearly all
    of it resident (an arena is returned only when empty); in the C heap, as the control
    worker runs, the trim returns it."""
    grown, kept = _after_burst(None)
    assert grown > 60 and kept > 0.8 * grown, (grown, kept)
    grown, kept = _after_burst(worker_main.environment("control", {})["PYTHONMALLOC"])
    assert grown > 60 and kept < 0.25 * grown, (grown, kept)


def test_python_m_worker_control_runs_on_the_c_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_main.environment("control", {}) == {"PYTHONMALLOC": "malloc"}
    assert worker_main.environment("control", {"PYTHONMALLOC": "pymalloc"}) == {
        "PYTHONMALLOC": "pymalloc"  # the operator's choice wins
    }
    assert "PYTHONMALLOC" not in worker_main.environment("model", {})
    started: list[tuple[list[str], dict[str, str]]] = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.append((argv, env))

    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    monkeypatch.setattr(worker_main.os, "execve", execve)
    worker_main.main(["control"])
    worker_main.main(["beat"])
    (control, control_env), (beat, beat_env) = started
    assert "batchd.control" in control and control_env["PYTHONMALLOC"] == "malloc"
    assert "beat" in beat and "PYTHONMALLOC" not in beat_env
