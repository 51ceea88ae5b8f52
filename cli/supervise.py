"""The process supervisor of ``batchd up``: runs named children (the API, the worker, beat;
each in the shared environment plus any variables of its own), starts again one that exits
while nobody asked it to (after a backoff that doubles from ``min_backoff_s`` to
``max_backoff_s`` with each exit in a row, and starts over once the child has run
``stable_s``), and on Ctrl-C or SIGTERM stops them all: SIGTERM, then SIGKILL for whatever is
left after ``grace_s``. Every exit and restart is logged.

A worker that cannot recover exits non-zero (worker/infra/liveness.py): this is what brings it back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cli.procfs import scan_children


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    exits_in_a_row: int = 0
    restart_at: float | None = None  # when an exited child is due to start again
    restarts: int = 0
    codes: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        commands: Mapping[str, list[str]],
        env: Mapping[str, str] | None = None,
        *,
        child_env: Mapping[str, Mapping[str, str]] | None = None,
        echo: Callable[[str], None] = print,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        poll_s: float = 0.5,
    ) -> None:
        self.children = {name: Child(name, list(cmd)) for name, cmd in commands.items()}
        self.env = dict(env) if env is not None else None
        self.child_env = {name: dict(extra) for name, extra in (child_env or {}).items()}
        self.echo = echo
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.poll_s = poll_s
        self.stopping = False
        self._subreaper = False

    def start(self) -> Supervisor:
        self._subreaper = _become_subreaper()
        for child in self.children.values():
            self._spawn(child)
        return self

    def _spawn(self, child: Child) -> None:
        env = self.env
        extra = self.child_env.get(child.name)
        if extra:  # this child's own variables on top of everyone's
            env = {**(os.environ if env is None else env), **extra}
        child.proc = subprocess.Popen(child.cmd, env=env)
        child.started_at = time.monotonic()
        child.restart_at = None

    def backoff_s(self, exits_in_a_row: int) -> float:
        return min(self.max_backoff_s, self.min_backoff_s * 2 ** max(0, exits_in_a_row - 1))

    def poll(self) -> None:
        """Notice children that exited and start again those that are due; reap orphans
        handed to this process that ended."""
        if self._subreaper:
            ours = {c.proc.pid for c in self.children.values() if c.proc is not None}
            for pid in scan_children(os.getpid(), zombies=True):
                if pid not in ours:  # the children's own exits are their Popen's to read
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
        now = time.monotonic()
        for child in self.children.values():
            if self.stopping:
                return
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self.echo(f"batchd up: starting {child.name} again (restart {child.restarts})")
                    self._spawn(child)
                continue
            code = child.proc.poll() if child.proc is not None else None
            if code is None:
                continue
            child.codes.append(code)
            ran = now - child.started_at
            child.exits_in_a_row = 1 if ran >= self.stable_s else child.exits_in_a_row + 1
            delay = self.backoff_s(child.exits_in_a_row)
            child.restart_at = now + delay
            self.echo(
                f"batchd up: {child.name} exited unexpectedly ({_describe(code)}) after "
                f"{ran:.0f}s; restarting in {delay:.0f}s"
            )

    def request_stop(self, *_args: object) -> None:
        """Signal-safe: only sets a flag that :meth:`run` reads."""
        self.stopping = True

    def run(self) -> None:
        """Supervise until Ctrl-C or SIGTERM (or :meth:`request_stop`), then stop all."""
        previous = {
            sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            while not self.stopping:
                self.poll()
                time.sleep(self.poll_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self, grace_s: float = 20.0) -> bool:
        """SIGTERM every running child, SIGKILL those left after ``grace_s``; True when every
        one ended within the grace period."""
        self.stopping = True
        running = [c.proc for c in self.children.values() if c.proc and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        clean = True
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                clean = False
                proc.kill()
                proc.wait()
        return self._wait_for_orphans(deadline) and clean

    def _wait_for_orphans(self, deadline: float) -> bool:
        """Wait for what the children started and left behind: multiprocessing's resource
        tracker under uvicorn's worker processes, say, exits only once they are gone. As a
        child subreaper (:meth:`start`) this process inherits such orphans; none may outlive
        ``batchd up``. SIGKILL for what is left after ``deadline``; True if none was killed.

        Done when the kernel says no child is left (``waitpid`` fails with ECHILD), not when a
        scan of /proc finds none: an orphan handed over while the scan runs can be missed by
        it (its entry read before its parent ended)."""
        if not self._subreaper:
            return True
        killed = False
        give_up = deadline + 10.0
        while True:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap the orphans that ended
                    pass
            except ChildProcessError:
                return not killed  # no child of any kind is left
            now = time.monotonic()
            if now >= deadline:
                for pid in scan_children(os.getpid()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed = True
                if now >= give_up:  # a child that does not die even so: stop waiting
                    return False
            time.sleep(0.05)


PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Orphaned descendants are handed to this process rather than to init (Linux's prctl);
    False where that is not available."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
