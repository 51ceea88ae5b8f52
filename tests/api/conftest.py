"""A real uvicorn server in a subprocess per test, on real Postgres, Redis and storage, and the
official ``openai`` client pointed at it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from core import launch

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0
# The catch-all handler logs this; ordinary bad input must never reach it.
UNHANDLED_MARKER = "unhandled error"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    return free_port()


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    #: A key of this test's own tenant, which ``client()`` and ``http()`` send unless told not to.
    api_key: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def storage_url(self) -> str:
        return self.env["BATCHD_STORAGE_URL"]

    def client(self, api_key: str | None = None, **kwargs) -> OpenAI:
        return OpenAI(
            base_url=f"{self.url}/v1",
            api_key=api_key or self.api_key or "sk-none",
            max_retries=0,
            **kwargs,
        )

    def http(self, api_key: str | None = "", **kwargs) -> httpx.Client:
        """A raw client sending ``api_key`` (default: the server's test key; None: no key)."""
        key = self.api_key if api_key == "" else api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        headers.update(kwargs.pop("headers", {}))
        return httpx.Client(base_url=self.url, timeout=60.0, headers=headers, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, field: str) -> int:
        """A ``/proc/<pid>/status`` memory field (VmRSS, VmHWM) of the server, in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)


def _wait_until_listening(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    host, port = server.url.removeprefix("http://").split(":")
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the API server exited early:\n{server.log()}")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the API server did not start within {STARTUP_TIMEOUT_S}s:\n{server.log()}")


@pytest.fixture
def make_key(pg_url: str) -> Callable[..., str]:
    """Create an API key in the database: ``make_key(tenant=None, **create_key options)``;
    each call without a tenant gets a tenant of its own."""
    import secrets

    from core.database.auth import create_key
    from core.database.sessions import session_scope

    def make(tenant: str | None = None, name: str = "test", **options) -> str:
        with session_scope(pg_url) as session:
            _row, plaintext = create_key(
                session, tenant or f"tenant-{secrets.token_hex(4)}", name, **options
            )
        return plaintext

    return make


@pytest.fixture
def api_key(make_key: Callable[..., str]) -> str:
    """A key of a fresh tenant: each test sees only its own files and batches."""
    return make_key()


@pytest.fixture
def start_server(
    service_env: dict[str, str], tmp_path: Path, api_key: str
) -> Iterator[Callable[..., Server]]:
    """Start ``uvicorn api.app:app`` with ``service_env`` plus overrides; stopped after the test,
    which fails if the server logged an unhandled error it was not told to expect."""
    started: list[tuple[Server, bool]] = []

    def start(allow_unhandled: bool = False, **overrides: str) -> Server:
        port = free_port()
        env = {**os.environ, **service_env, **overrides}
        env["PYTHONUNBUFFERED"] = "1"
        log_path = tmp_path / f"server-{port}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            launch.api_command(port, log_level="warning"),
            cwd=REPO_ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        server = Server(f"http://127.0.0.1:{port}", process, log_path, env, api_key)
        started.append((server, allow_unhandled))
        _wait_until_listening(server)
        return server

    yield start
    for server, allow_unhandled in started:
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
        if not allow_unhandled:
            assert UNHANDLED_MARKER not in server.log(), server.log()


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    return start_server()


@pytest.fixture
def client(server: Server) -> OpenAI:
    return server.client()


@pytest.fixture
def control_messages(redis_url: str) -> Callable[[str], list[dict]]:
    """The task messages waiting on the broker's control queue, decoded: [{task, args}]."""
    import base64

    import redis

    from core.broker.queue import CONTROL_QUEUE

    conn = redis.Redis.from_url(redis_url)

    def read(task: str) -> list[dict]:
        messages = []
        for raw in conn.lrange(CONTROL_QUEUE, 0, -1):
            message = json.loads(raw)
            body = message["body"]
            if message.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args, _kwargs, _embed = json.loads(body)
            if message["headers"]["task"] == task:
                messages.append({"task": task, "args": args})
        return messages

    yield read
    conn.close()
