"""Helpers the service benchmarks share: a fresh Postgres database, a private Redis, the
service's processes (API under uvicorn, control worker, model worker, beat) as subprocesses
logging to a directory, the model worker's engine stats over Celery remote control, and the
resident memory of a process from ``/proc``.

The same approach as ``tests/e2e/conftest.py``: real servers, real connections, one process
group per service process so stopping it stops everything it started.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = "batchd-demo"
API_KEY = "sk-bench-key"
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"
TERMINAL = {"completed", "failed", "expired", "cancelled"}

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Database:
    """A fresh database on the local Postgres server, migrated; ``drop()`` removes it."""

    def __init__(self, admin_url: str = PG_ADMIN_URL, prefix: str = "batchd_bench"):
        from sqlalchemy import create_engine, text

        import migrations

        self.name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
        self._admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        self.url = admin_url.rsplit("/", 1)[0] + f"/{self.name}"
        migrations.upgrade(self.url)

    def drop(self) -> None:
        from sqlalchemy import text

        try:
            from core.db import get_engine

            get_engine(self.url).dispose()
        except Exception:
            pass
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()


class Broker:
    """A private ``redis-server`` on a free port; without the binary, a database index of the
    local Redis (``fallback_url``'s server) that this run empties first."""

    def __init__(self, root: Path, fallback_url: str = REDIS_URL):
        self._proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            import redis

            base, _, _index = fallback_url.rpartition("/")
            self.url = f"{base}/{1 + secrets.randbelow(15)}"
            redis.Redis.from_url(self.url).flushdb()
            return
        port = free_port()
        self._proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 15
        while not _port_open(port):
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise RuntimeError("the private redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)


def service_env(root: Path, database_url: str, broker_url: str, **overrides: str) -> dict[str, str]:
    """The environment of a private service on ``root`` (``overrides`` win)."""
    (root / "home").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_BROKER_URL": broker_url,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_API_KEYS": API_KEY,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",  # the benchmark polls faster than a client would
        **overrides,
    }


CELERY = [sys.executable, "-m", "celery", "-A", "worker.celery_app"]
QUIET = ["--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]


def commands(port: int, root: Path, shard_concurrency: int) -> dict[str, list[str]]:
    """Command lines of the service processes (as ``python -m worker`` builds them)."""
    return {
        "api": [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"],
        "control": [*CELERY, "worker", "-Q", "batchd.control", "--pool", "threads", "-c", "2",
                    "-n", "control@bench", *QUIET],
        "model": [*CELERY, "worker", "-Q", f"batchd.model.{MODEL}", "--pool", "threads",
                  "-c", str(shard_concurrency), "-n", "model@bench", *QUIET],
        "beat": [*CELERY, "beat", "-s", str(root / "home" / "beat-schedule"),
                 "--loglevel", "INFO"],
    }  # fmt: skip


@dataclass
class Stack:
    """Service processes started from ``commands``, each logging to ``root/<name>.log``."""

    root: Path
    env: dict[str, str]
    port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, roles: Iterable[str], shard_concurrency: int = 4) -> Stack:
        cmds = commands(self.port, self.root, shard_concurrency)
        for name in roles:
            with open(self.root / f"{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(
                    cmds[name], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
        return self

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, chars: int = 3000) -> str:
        return "".join(f"\n--- {n}.log\n{self.log(n)[-chars:]}" for n in self.procs)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):{self.logs()}")

    def api_up(self) -> bool:
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """The API answers, the control worker is ready, the model worker has its model."""

        def ready() -> bool:
            self.check_alive()
            if "api" in self.procs and not self.api_up():
                return False
            if "control" in self.procs and "ready." not in self.log("control"):
                return False
            return "model" not in self.procs or f"model {MODEL} ready" in self.log("model")

        wait_for(ready, timeout, "the service to start", self.logs)

    def client(self, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=2, **kw)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}{logs() if logs else ''}")


class EngineStatsProbe:
    """Asks one worker for ``engine_stats`` (the remote-control command in worker.runtime)."""

    def __init__(self, broker_url: str, worker: str = "model@bench"):
        from celery import Celery

        self.app = Celery("batchd-bench", broker=broker_url)
        self.worker = worker

    def __call__(self, timeout: float = 1.0) -> dict[str, Any] | None:
        replies = self.app.control.broadcast(
            "engine_stats", destination=[self.worker], reply=True, timeout=timeout
        )
        for reply in replies or ():
            answer = reply.get(self.worker)
            if isinstance(answer, dict) and "models" in answer:
                return answer
        return None

    def close(self) -> None:
        self.app.close()


def memory_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of ``pid`` in KiB, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    if len(values) != 2:
        return None
    return values["VmRSS"], values["VmHWM"]
