"""The private redis-server of the test and benchmark stacks: it is up only when the server
answering on its port is its own, so two runs side by side never share a broker."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import redis

from cli.perf.service import free_port
from testkit.service import stack

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs the redis-server binary"
)


def _ports_then_free(monkeypatch: pytest.MonkeyPatch, taken: int) -> list[int]:
    """``free_port`` hands out ``taken`` first (as a race with another run would), then free
    ports; returns the ports it handed out."""
    handed: list[int] = []

    def fake() -> int:
        handed.append(taken if not handed else free_port())
        return handed[-1]

    monkeypatch.setattr(stack, "free_port", fake)
    return handed


def _pid_on(port: int) -> int:
    with redis.Redis(host="127.0.0.1", port=port) as client:
        return int(client.info("server")["process_id"])


def test_a_port_another_redis_holds_is_not_taken_for_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = stack.RedisServer(tmp_path, fallback_url="redis://127.0.0.1:6379/1")
    try:
        other_port = int(other.url.rsplit(":", 1)[1].split("/")[0])
        handed = _ports_then_free(monkeypatch, other_port)
        ours = stack.RedisServer(tmp_path, fallback_url="redis://127.0.0.1:6379/1")
        try:
            port = int(ours.url.rsplit(":", 1)[1].split("/")[0])
            assert handed[0] == other_port and port == handed[-1] != other_port
            assert _pid_on(port) == ours.pid and _pid_on(other_port) == other.pid
        finally:
            ours.stop()
        assert _pid_on(other_port) == other.pid  # the other run's server is left alone
    finally:
        other.stop()


def test_a_port_held_by_something_else_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held = listener.getsockname()[1]
        handed = _ports_then_free(monkeypatch, held)
        ours = stack.RedisServer(tmp_path, fallback_url="redis://127.0.0.1:6379/1")
        try:
            assert len(handed) == 2 and ours.url.endswith(f":{handed[1]}/0")
            assert _pid_on(handed[1]) == ours.pid
        finally:
            ours.stop()


def test_a_server_that_cannot_start_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack.RedisServer, "ATTEMPTS", 2)
    with pytest.raises(RuntimeError, match="did not come up on a port of its own in 2 tries"):
        stack.RedisServer(tmp_path / "missing", fallback_url="redis://127.0.0.1:6379/1")
