"""Intra-op threads that follow the CPU the rest of the machine leaves free.

:class:`CpuThreads` samples, every ``interval_s``, how busy this process's CPUs were (Linux
``/proc/stat``; niced processes' time not counted unless the engine is niced too) less the
engine's own share, and sizes torch's team to the cores left free:
never below 1, never above the team it started with. Off the CPU, or where ``/proc/stat``
cannot be read, it does nothing. Why: docs/engine.md ("Threads on a shared CPU").
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(
    cpus: frozenset[int], path: str = "/proc/stat", count_nice: bool = False
) -> int | None:
    """Busy clock ticks (everything but idle and iowait) of ``cpus`` since boot, or None.
    Niced processes' ticks count only with ``count_nice``: the scheduler gives a core to a
    process of normal priority over them (a nice-19 process gets 1/70 of its share), so for an
    engine that is not niced itself they leave the core free."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            if int(name[3:]) not in cpus:
                continue
            values = [int(v) for v in rest.split()]
        except ValueError:
            continue
        # user nice system idle iowait irq softirq steal ...: stolen time is not ours either
        busy += sum(values[:8]) - values[3] - values[4] - (0 if count_nice else values[1])
    return busy


def _niced() -> bool:
    """Whether this process runs below normal priority (a positive nice value)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0) > 0
    except (AttributeError, OSError):
        return False


class CpuThreads:
    """Size torch's intra-op team, on the stepping thread, to the cores others leave free."""

    def __init__(self, max_threads: int, interval_s: float = 0.5) -> None:
        self.max_threads = max(1, int(max_threads))
        self.interval_s = interval_s
        try:
            self.cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = frozenset(range(os.cpu_count() or 1))
        self.threads = self.max_threads
        # A niced engine meets niced processes on equal terms: their time counts then.
        self.count_nice = _niced()
        self.enabled = self.max_threads > 1 and _busy_ticks(self.cpus) is not None
        self._last: tuple[float, float, float, int] | None = None  # wall, thread, process, busy
        self.changes = 0

    def others(
        self, wall_s: float, thread_cpu_s: float, process_cpu_s: float, busy_ticks: int
    ) -> float | None:
        """Cores the rest of the machine kept busy since the last sample (None: first one).
        ``thread_cpu_s``: the stepping thread's CPU time; ``process_cpu_s``: this process's."""
        last, self._last = self._last, (wall_s, thread_cpu_s, process_cpu_s, busy_ticks)
        if last is None or wall_s <= last[0]:
            return None
        busy_s = (busy_ticks - last[3]) / TICKS_PER_S
        ours = min((thread_cpu_s - last[1]) * self.threads, process_cpu_s - last[2])
        return max(0.0, busy_s - ours) / (wall_s - last[0])

    def target(self, others: float) -> int:
        """The team for ``others`` busy cores: the free cores, rounded, in [1, max_threads]."""
        return max(1, min(self.max_threads, round(len(self.cpus) - others)))

    def poll(self) -> None:
        """Call before a step on the thread that steps; cheap between samples."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return
        busy = _busy_ticks(self.cpus, count_nice=self.count_nice)
        if busy is None:
            self.enabled = False
            return
        others = self.others(now, time.thread_time(), time.process_time(), busy)
        if others is None:
            self._apply(self.threads)  # the stepping thread's team, set on that thread
            return
        threads = self.target(others)
        if threads != self.threads:
            logger.debug(
                "intra-op threads %d -> %d (%.2f cores busy elsewhere)",
                self.threads,
                threads,
                others,
            )
            self.changes += 1
            self._apply(threads)

    def _apply(self, threads: int) -> None:
        import torch

        self.threads = threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
