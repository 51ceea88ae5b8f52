"""The service's processes as subprocesses: the API under uvicorn, control and model workers
and beat (their command lines and environment), each in its own process group and logging to
``root/<name>.log``; a private ``redis-server``; waiting for readiness. The e2e tests and the
service benchmarks (scripts/_bench_stack.py) start the service through this module.

The process handling is ``batchd bench``'s (:mod:`cli.perf.service`, which imports only the
standard library until it starts a service of its own); nothing else here imports the
service's packages: it only runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cli.perf import service
from cli.perf.service import api_command, free_port, wait_for
from tests.helpers.lines import MODEL

__all__ = ["Procs", "api_command", "free_port", "wait_for"]

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-e2e-test-key"
CELERY = [sys.executable, "-m", "celery", "-A", "worker.celery_app"]
QUIET = ["--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def celery_command(
    kind: str, name: str, root: Path, concurrency: int = 2, *, host: str = "e2e"
) -> list[str]:
    """A control worker, a model worker (the demo model's queue) or beat, named
    ``name@host``."""
    if kind == "beat":
        return [*CELERY, "beat", "-s", str(root / f"beat-schedule-{name}"), "--loglevel", "INFO"]
    queue = "batchd.control" if kind == "control" else f"batchd.model.{MODEL}"
    return [*CELERY, "worker", "-Q", queue, "--pool", "threads", "-c", str(concurrency),
            "-n", f"{name}@{host}", *QUIET]  # fmt: skip


def stack_env(
    database_url: str, broker_url: str, root: Path, *, api_key: str = API_KEY, **overrides: str
) -> dict[str, str]:
    """The environment of a private service on ``root`` serving the tiny demo model
    (``overrides`` win; engine options in ``BATCHD_ENGINE_OPTIONS`` get ``dtype`` float32
    unless they name one)."""
    (root / "home").mkdir(parents=True, exist_ok=True)
    # The engine in float32 unless a test says otherwise: the tests' oracle is greedy text
    # equal to another run's, which bf16 (the default on a CPU that multiplies it natively)
    # keeps only where both runs batch the same sequences together.
    inherited = os.environ.get("BATCHD_ENGINE_OPTIONS") or "{}"
    options = json.loads(overrides.pop("BATCHD_ENGINE_OPTIONS", inherited))
    options.setdefault("dtype", "float32")
    return {
        **os.environ,
        "BATCHD_ENGINE_OPTIONS": json.dumps(options),
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_BROKER_URL": broker_url,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_API_KEYS": api_key,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",  # tests and benchmarks poll faster than clients
        **overrides,
    }


class Procs(service.Procs):
    """The service's processes run from the repository, as the tests start and kill them."""

    def __init__(self, root: Path):
        super().__init__(root, cwd=REPO)

    def wait_log(self, name: str, text: str, timeout: float, count: int = 1) -> None:
        def seen() -> bool:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited:{self.logs()}")
            return self.log(name).count(text) >= count

        wait_for(seen, timeout, f"{text!r} in {name}.log", self.logs)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(30)


class RedisServer:
    """A private ``redis-server`` on a free port (no queue shared with anyone); without the
    binary, ``fallback_url`` (a database of a shared server), emptied. ``stop()`` ends it."""

    def __init__(self, directory: Path, fallback_url: str):
        self._proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            import redis

            redis.Redis.from_url(fallback_url).flushdb()
            self.url = fallback_url
            return
        port = free_port()
        self._proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{port}/0"
        proc = self._proc

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError("the private redis-server exited")
            return port_open(port)

        try:
            wait_for(up, 15, "the private redis-server")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)


@contextmanager
def private_redis(redis_url: str, directory: Path) -> Iterator[str]:
    """A private redis-server on a free port (no queue is shared with anyone); without the
    binary, the next database index of ``redis_url``'s server, emptied."""
    base, _, index = redis_url.rpartition("/")
    server = RedisServer(directory, fallback_url=f"{base}/{(int(index) + 1) % 15 + 1}")
    try:
        yield server.url
    finally:
        server.stop()
