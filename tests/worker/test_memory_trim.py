"""The allocator trimmer of worker processes (worker/memory.py)."""

from __future__ import annotations

import os
import threading

import pytest

from worker import memory

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
