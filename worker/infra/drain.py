"""A worker's drain on SIGTERM: take no new shard, let the requests in flight finish for
``worker_drain_s``, hand back what is left, exit.

Celery's warm shutdown (SIGTERM) stops consuming and waits for the running tasks.
:func:`begin`, called at ``worker_shutting_down``, tells the running shard attempts
(``worker.shards.run.ShardRun``) to feed their host no more, and once :meth:`Drain.time_up` to
abort what is still in flight, checkpoint what finished and hand the shard back
(``worker.shards.state.hand_back``); a shard task that starts meanwhile puts its message back
on the queue. The tasks then return and the worker exits 0. Should the process still be alive
:data:`HAND_BACK_S` after the drain's end (a task stuck retrying the database, a broker that
does not answer the shutdown), it exits with :data:`EXIT_UNDRAINED`: what it held is then
recovered as after a SIGKILL (checkpoints, the reclaim sweep). Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

EXIT_UNDRAINED = 4
# After the drain's end: the abort, the last checkpoints, the hand-backs and the exit.
HAND_BACK_S = 15.0


class Drain:
    """One process's drain: not started until :meth:`begin`; ``exit`` ends the process (a
    test seam)."""

    def __init__(self, exit: Callable[[int], object] = os._exit) -> None:
        self._started = threading.Event()
        self._deadline = math.inf
        self._drain_s = 0.0
        self._bound_s: float | None = None
        self._exit = exit
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def time_up(self) -> bool:
        """Whether the requests still in flight are to be aborted and handed back now."""
        return self._started.is_set() and time.monotonic() >= self._deadline

    def left_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def arm(self) -> Drain:
        """Start the thread that will log the drain and bound it (once), so that
        :meth:`begin`, called in a signal handler, starts no thread."""
        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch, name="batchd-drain", daemon=True
                )
                self._watcher.start()
        return self

    def begin(self, drain_s: float, bound_s: float | None = HAND_BACK_S) -> None:
        """Start draining (once): ``drain_s`` from now the rest is handed back, and
        ``bound_s`` after that the process exits whatever it is doing (None: never). It only
        sets a deadline and a flag (it may run in a signal handler); the armed thread logs."""
        if self._started.is_set():
            return
        self._drain_s, self._bound_s = max(0.0, drain_s), bound_s
        self._deadline = time.monotonic() + self._drain_s
        self._started.set()
        if self._watcher is None:
            self.arm()

    def _watch(self) -> None:
        self._started.wait()
        logger.warning(
            "draining: no new shard; requests in flight have %.0fs to finish, then the rest "
            "is handed back",
            self._drain_s,
        )
        if self._bound_s is None:
            return
        time.sleep(self.left_s() + self._bound_s)
        logger.critical(
            "the drain did not end %.0fs after its %.0fs (worker_drain_s); exiting (%d), what "
            "this worker held is recovered as after a crash",
            self._bound_s,
            self._drain_s,
            EXIT_UNDRAINED,
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self._exit(EXIT_UNDRAINED)


_process = Drain()


def process_drain() -> Drain:
    """This process's drain."""
    return _process


def arm() -> None:
    """Ready this process's drain (at worker start; see :meth:`Drain.arm`)."""
    _process.arm()


def begin(drain_s: float) -> None:
    """Start this process's drain (see :meth:`Drain.begin`)."""
    _process.begin(drain_s)
