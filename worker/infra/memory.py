"""Give the C allocator's free memory back to the system every few seconds.

glibc returns freed memory only from the top of a heap, and a worker frees in the middle of its
heaps all the time, so its RSS climbed while its use stayed flat. A daemon thread calls
``malloc_trim(0)`` every :data:`INTERVAL_S`; where the C library has none (musl, macOS) nothing
runs. Measured: ``docs/operations.md``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

INTERVAL_S = 15.0

_thread: threading.Thread | None = None
_lock = threading.Lock()


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_trim = _malloc_trim()


def available() -> bool:
    return _trim is not None


def trim() -> bool:
    """Return the allocator's free pages to the system now; whether any were returned."""
    return bool(_trim(0)) if _trim is not None else False


def start(interval_s: float = INTERVAL_S) -> threading.Thread | None:
    """Start the trimming thread (once per process); None where there is nothing to call."""
    global _thread
    if _trim is None:
        return None
    with _lock:
        if _thread is None or not _thread.is_alive():

            def run() -> None:  # as long as the process lives
                while True:
                    time.sleep(interval_s)
                    trim()

            _thread = threading.Thread(target=run, name="batchd-malloc-trim", daemon=True)
            _thread.start()
        return _thread
