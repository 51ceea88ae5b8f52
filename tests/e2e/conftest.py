"""The whole service, for real: the API under uvicorn, a control worker, a model worker and
beat as subprocesses on Postgres, Redis and a local storage directory, serving the tiny demo
model. Started once per test module; tests talk to it with the official ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MODEL = "batchd-demo"
API_KEY = "sk-e2e-test-key"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stack:
    base_url: str
    env: dict[str, str]
    root: Path
    client: Any  # openai.OpenAI

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_redis_db(redis_url: str) -> str:
    """A Redis database index of its own, so queues never mix with other tests' messages."""
    base, _, index = redis_url.rpartition("/")
    mine = (int(index) % 15) + 1
    return f"{base}/{mine}"


def _wait_for(predicate, timeout: float, what: str, logs: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = ""
    if logs is not None:
        for path in sorted(logs.glob("*.log")):
            tail += f"\n--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
    raise TimeoutError(f"timed out waiting for {what}{tail}")


@pytest.fixture(scope="module")
def stack(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import redis
    from openai import OpenAI

    from engine.demo_models import build

    build("llama-tiny")  # once, before two processes race to build it
    root = tmp_path_factory.mktemp("e2e")
    broker = _own_redis_db(redis_url)
    redis.Redis.from_url(broker).flushdb()
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": pg_url,
        "BATCHD_BROKER_URL": broker,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_API_KEYS": API_KEY,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",  # the tests poll faster than a client would
        "BATCHD_CHECKPOINT_EVERY": "4",
        "BATCHD_CHECKPOINT_INTERVAL_S": "0.5",
        "BATCHD_SHARD_MAX_REQUESTS": "16",
        "BATCHD_WORKER_SHARD_CONCURRENCY": "2",
        "BATCHD_EXPIRY_SWEEP_INTERVAL_S": "1",
        # A small running batch keeps long workloads long enough to cancel or expire mid-way.
        # Arrival order (not longest-first) so the quick requests at the head finish first.
        "BATCHD_ENGINE_OPTIONS": json.dumps({"max_num_seqs": 4, "admission": "fcfs"}),
    }
    (root / "home").mkdir()
    celery = [sys.executable, "-m", "celery", "-A", "worker.celery_app"]
    commands = {
        "api": [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"],
        "control": [*celery, "worker", "-Q", "batchd.control", "--pool", "threads", "-c", "2",
                    "-n", "control@e2e", "--loglevel", "INFO", "--without-gossip",
                    "--without-mingle", "--without-heartbeat"],
        "model": [*celery, "worker", "-Q", f"batchd.model.{MODEL}", "--pool", "threads",
                  "-c", "2", "-n", "model@e2e", "--loglevel", "INFO", "--without-gossip",
                  "--without-mingle", "--without-heartbeat"],
        "beat": [*celery, "beat", "-s", str(root / "home" / "beat-schedule"), "--loglevel", "INFO"],
    }  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in commands.items():
            log = open(root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            procs[name] = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        stack = Stack(
            f"http://127.0.0.1:{port}/v1",
            env,
            root,
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0),
        )

        def api_up() -> bool:
            import httpx

            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        def alive() -> None:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{stack.log(name)[-3000:]}")

        def ready() -> bool:
            alive()
            return (
                api_up()
                and "ready." in stack.log("control")
                and f"model {MODEL} ready" in stack.log("model")
            )

        _wait_for(ready, 120, "the API, the workers and the model", root)
        yield stack
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ---------------------------------------------------------------------------------------------
# Processes a test starts, kills and restarts itself (crash recovery and outage tests).

CELERY = [sys.executable, "-m", "celery", "-A", "worker.celery_app"]


def celery_command(kind: str, name: str, root: Path, concurrency: int = 2) -> list[str]:
    """A control worker, a model worker (the demo model's queue) or beat."""
    if kind == "beat":
        return [*CELERY, "beat", "-s", str(root / f"beat-schedule-{name}"), "--loglevel", "INFO"]
    queue = "batchd.control" if kind == "control" else f"batchd.model.{MODEL}"
    return [*CELERY, "worker", "-Q", queue, "--pool", "threads", "-c", str(concurrency),
            "-n", f"{name}@e2e", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
            "--without-heartbeat"]  # fmt: skip


def api_command(port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip


def base_env(pg_url: str, broker: str, root: Path, **overrides: str) -> dict[str, str]:
    """The environment of a private service on ``root`` (tiny model, small checkpoints)."""
    (root / "home").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": pg_url,
        "BATCHD_BROKER_URL": broker,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_API_KEYS": API_KEY,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",
        **overrides,
    }


class Procs:
    """Named subprocesses, each logging to ``root/<name>.log`` (appended across restarts);
    all are killed when the test ends."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, chars: int = 3000) -> str:
        return "".join(
            f"\n--- {p.name}\n" + p.read_text(errors="replace")[-chars:]
            for p in sorted(self.root.glob("*.log"))
        )

    def wait_log(self, name: str, text: str, timeout: float, count: int = 1) -> None:
        def seen() -> bool:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited:{self.logs()}")
            return self.log(name).count(text) >= count

        _wait_for(seen, timeout, f"{text!r} in {name}.log", self.root)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    from engine.demo_models import build

    build("llama-tiny")  # once, before several processes race to build it
    manager = Procs(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()


@contextmanager
def private_redis(redis_url: str, directory: Path) -> Iterator[str]:
    """A private redis-server on a free port (no queue is shared with anyone); without the
    binary, a Redis database index of the shared server, emptied."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        base, _, index = redis_url.rpartition("/")
        url = f"{base}/{(int(index) + 1) % 15 + 1}"
        redis.Redis.from_url(url).flushdb()
        yield url
        return
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for(lambda: _port_open(port), 10, "the private redis-server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def private_broker(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """A private broker for this test (see :func:`private_redis`)."""
    with private_redis(redis_url, tmp_path) as url:
        yield url


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
