"""A worker's liveness: tell a hung worker from a busy one, and end a hung one.

Celery's consumer turns its event loop in the worker's main thread: it receives tasks, sends
acknowledgements and answers remote control there, while the tasks run in the pool's threads.
A busy worker (every thread inside a long shard) still turns its loop every few seconds; a
hung one (a wedged socket, a deadlock, a consumer that died and left the process behind) does
not. Each turn is recorded (``hub.on_tick``), and a watchdog thread, started when the worker is
ready, every ``worker_liveness_interval_s``:

* touches ``worker_liveness_file`` (when set) if the loop turned within
  ``worker_hang_timeout_s``, or if the consumer is reconnecting to the broker (its connection
  is gone while it runs; each attempt is bounded by the transport's socket timeouts, see
  :func:`worker.celery_app.transport_options`), and every engine host the process loaded is
  alive;
* otherwise logs why and ends the process with :data:`EXIT_UNHEALTHY`, so that its supervisor
  (compose's ``restart:``, ``batchd up``, systemd) starts a fresh one. Nothing is lost: the
  control tasks it held are delivered again (late acknowledgement), its shards are re-queued by
  the reclaim sweep once their heartbeats stop and resume from their last checkpoint.

An engine host does not come back in the process that lost it (``worker.runtime.host`` keeps
it), so a model worker whose engine died would take shards only to fail them: it exits too.

``python -m worker health`` (the compose healthcheck) exits 0 while the file is fresh.

A requested shutdown (SIGTERM, SIGINT) stops the watchdog: the supervisor that asked bounds it.
Without an event loop (Celery's SQLAlchemy transport of ``batchd up``'s embedded mode polls
without one) there is nothing to watch and no watchdog starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from core.settings import get_settings

logger = logging.getLogger(__name__)

EXIT_UNHEALTHY = 3


def max_age_s(interval_s: float) -> float:
    """How old the liveness file may be while its worker is healthy."""
    return max(3 * interval_s, 30.0)


def file_age_s(path: str | os.PathLike[str]) -> float | None:
    """Seconds since ``path`` was last touched; None if it does not exist."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except FileNotFoundError:
        return None


def health(path: str | None = None, interval_s: float | None = None) -> tuple[bool, str]:
    """(healthy, why) for the worker that touches ``path`` (default: the settings')."""
    settings = get_settings()
    path = path or settings.worker_liveness_file
    if not path:
        return False, "BATCHD_WORKER_LIVENESS_FILE is not set"
    limit = max_age_s(settings.worker_liveness_interval_s if interval_s is None else interval_s)
    age = file_age_s(path)
    if age is None:
        return False, f"{path} does not exist (the worker is not ready, or never was)"
    if age > limit:
        return False, f"{path} was last touched {age:.0f}s ago (more than {limit:.0f}s)"
    return True, f"{path} touched {age:.1f}s ago"


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
        exit: Any = os._exit,
    ) -> None:
        self.consumer = consumer
        self.path = Path(path) if path else None
        self.interval_s = max(0.05, float(interval_s))
        self.hang_timeout_s = float(hang_timeout_s)
        self._exit = exit
        self.last_tick = time.monotonic()
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
        from celery import bootsteps

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
        runtime = sys.modules.get("worker.runtime")
        if runtime is not None:
            for model, host in runtime.loaded_hosts().items():
                if not getattr(host, "is_alive", True):
                    return f"the engine host of model {model} has stopped"
        return None

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


def start(consumer: Any) -> Watchdog | None:
    """Start this process's watchdog for ``consumer`` (once; None without an event loop)."""
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
    ).start()
    return _watchdog


def stop() -> None:
    if _watchdog is not None:
        _watchdog.stop()
