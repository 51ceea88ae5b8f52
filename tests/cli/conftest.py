"""Fixtures for the ``batchd`` command: a real API server (uvicorn subprocess on real Postgres,
Redis and storage) and a CLI runner bound to it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core import launch

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ApiServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def api_server(service_env: dict[str, str], tmp_path: Path) -> Iterator[ApiServer]:
    """``uvicorn api.app:app`` with no worker: batches stay where the API leaves them."""
    port = free_port()
    log_path = tmp_path / "api.log"
    env = {**os.environ, **service_env, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            launch.api_command(port, log_level="warning"),
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = ApiServer(f"http://127.0.0.1:{port}/v1", process, log_path)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the API server exited early:\n{server.log()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the API server did not start:\n{server.log()}") from None
            time.sleep(0.1)
    yield server
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()
