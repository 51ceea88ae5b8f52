"""A worker's liveness: tell a hung worker from a busy one, and end a hung one.

A watchdog thread touches ``worker_liveness_file`` while the consumer's event loop turns (or
reconnects) and every loaded engine host is alive; otherwise, or when control tasks stall the
pool for ``worker_stall_timeout_s``, it ends the process with :data:`EXIT_UNHEALTHY` for its
supervisor to restart. ``python -m worker health`` reads the file. Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import bootsteps
from celery.worker import state

from core.settings import get_settings
from worker.infra import runtime

logger = logging.getLogger(__name__)

EXIT_UNHEALTHY = 3


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """What a worker's pool holds at one moment: the control tasks running (request ids, and
    their names), the control tasks received and due that wait for a thread, how many control
    tasks have started so far, and the tasks of any kind running against the pool's size."""

    running: frozenset[str] = frozenset()
    waiting: int = 0
    started: int = 0
    busy: int = 0
    size: int = 0
    names: tuple[str, ...] = ()


def progressed(before: PoolSnapshot | None, after: PoolSnapshot) -> bool:
    """Whether a control task started or finished between the two snapshots."""
    if before is None:
        return True
    return after.started != before.started or not before.running <= after.running


def pool_stall(snapshot: PoolSnapshot, idle_s: float, timeout_s: float) -> str | None:
    """Why the control pool is stalled, or None: control tasks are running, more wait for a
    thread or no thread is free, and none has started or finished for ``idle_s`` > ``timeout_s``
    (0: never). A pure function."""
    if timeout_s <= 0 or not snapshot.running or idle_s <= timeout_s:
        return None
    if snapshot.waiting == 0 and snapshot.busy < snapshot.size:
        return None  # a free thread: the pool can still take the next task
    names = ", ".join(sorted(set(snapshot.names))) or "?"
    return (
        f"no control task has started or finished for {idle_s:.0f}s "
        f"(worker_stall_timeout_s={timeout_s:g}): {len(snapshot.running)} running ({names}), "
        f"{snapshot.waiting} waiting, {snapshot.busy} of {snapshot.size} threads busy"
    )


def pool_snapshot(consumer: Any, control_tasks: frozenset[str]) -> PoolSnapshot:
    """This process's :class:`PoolSnapshot`, from Celery's worker state."""
    for _ in range(5):  # the consumer's thread may change the sets while they are copied
        try:
            active = list(state.active_requests)
            reserved = list(state.reserved_requests)
            started = sum(state.total_count.get(name, 0) for name in control_tasks)
            break
        except RuntimeError:
            time.sleep(0.01)
    else:
        return PoolSnapshot()
    running = [r for r in active if r.name in control_tasks]
    active_ids = {r.id for r in active}
    waiting = sum(1 for r in reserved if r.name in control_tasks and r.id not in active_ids)
    pool = getattr(consumer, "pool", None)
    size = getattr(pool, "num_processes", None) or getattr(
        getattr(consumer, "controller", None), "concurrency", 0
    )
    return PoolSnapshot(
        running=frozenset(r.id for r in running),
        waiting=waiting,
        started=started,
        busy=len(active),
        size=int(size or 0),
        names=tuple(r.name for r in running),
    )


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()  # sets the time of an existing file too


class Watchdog:
    """See the module docstring. ``consumer`` is Celery's consumer (``worker_ready``'s
    sender); ``exit`` ends the process (a test seam)."""

    def __init__(
        self,
        consumer: Any,
        *,
        path: str = "",
        interval_s: float = 10.0,
        hang_timeout_s: float = 300.0,
        stall_timeout_s: float = 0.0,
        control_tasks: frozenset[str] = frozenset(),
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.consumer = consumer
        self.path = Path(path) if path else None
        self.interval_s = max(0.05, float(interval_s))
        self.hang_timeout_s = float(hang_timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self.control_tasks = control_tasks
        self._exit = exit
        self.last_tick = time.monotonic()
        self.last_progress = self.last_tick
        self._pool: PoolSnapshot | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-liveness", daemon=True)

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def start(self) -> Watchdog:
        self.consumer.hub.on_tick.add(self.tick)
        self.check()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def reconnecting(self) -> bool:
        blueprint = getattr(self.consumer, "blueprint", None)
        return (
            getattr(self.consumer, "connection", True) is None
            and getattr(blueprint, "state", None) == bootsteps.RUN
        )

    def problem(self) -> str | None:
        """Why this worker is hung, or None."""
        if self.reconnecting():
            self.tick()  # each reconnect attempt is bounded; waiting for the broker is not a hang
        stalled = time.monotonic() - self.last_tick
        if self.hang_timeout_s > 0 and stalled > self.hang_timeout_s:
            return (
                f"the consumer's event loop has not turned for {stalled:.0f}s "
                f"(worker_hang_timeout_s={self.hang_timeout_s:g})"
            )
        stalled_pool = self.pool_problem()
        if stalled_pool is not None:
            return stalled_pool
        for model, host in runtime.loaded_hosts().items():
            if not getattr(host, "is_alive", True):
                return f"the engine host of model {model} has stopped"
        return None

    def pool_problem(self) -> str | None:
        """Why the control tasks in this worker's pool are stalled, or None."""
        if self.stall_timeout_s <= 0:
            return None
        snapshot = pool_snapshot(self.consumer, self.control_tasks)
        current = time.monotonic()
        if progressed(self._pool, snapshot):
            self.last_progress = current
        self._pool = snapshot
        return pool_stall(snapshot, current - self.last_progress, self.stall_timeout_s)

    def check(self) -> bool:
        """One round: touch the file, or end the process. False once it was told to end."""
        if self._stop.is_set():
            return True
        why = self.problem()
        if why is None:
            if self.path is not None:
                try:
                    touch(self.path)
                except OSError as exc:
                    logger.warning("could not touch the liveness file %s: %s", self.path, exc)
            return True
        logger.critical("worker unhealthy: %s; exiting (%d) to be restarted", why, EXIT_UNHEALTHY)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self._exit(EXIT_UNHEALTHY)
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.check():
                return


_watchdog: Watchdog | None = None


def start(consumer: Any, control_tasks: frozenset[str]) -> Watchdog | None:
    """Start this process's watchdog for ``consumer``, watching ``control_tasks`` in its pool
    (once; None without an event loop)."""
    global _watchdog
    if _watchdog is not None:
        return _watchdog
    if getattr(consumer, "hub", None) is None:
        logger.info("liveness: no event loop to watch (a polling transport); no watchdog")
        return None
    settings = get_settings()
    _watchdog = Watchdog(
        consumer,
        path=settings.worker_liveness_file,
        interval_s=settings.worker_liveness_interval_s,
        hang_timeout_s=settings.worker_hang_timeout_s,
        stall_timeout_s=settings.worker_stall_timeout_s,
        control_tasks=control_tasks,
    ).start()
    return _watchdog


def stop() -> None:
    if _watchdog is not None:
        _watchdog.stop()
