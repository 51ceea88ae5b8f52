"""A worker says where its metrics exporter listens, once its log is set up; a port it cannot
bind is logged as an error naming the port, and the worker still starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cli.perf.service import free_port
from core.launch import QUIET, control_worker_command
from testkit.service.stack import Procs, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _control(name: str) -> list[str]:
    return control_worker_command(f"{name}@exporter", 1, extra=QUIET)


def test_worker_logs_where_its_exporter_listens(pg_url: str, redis_url: str, tmp_path: Path):
    import httpx

    free, busy = free_port(), socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    procs = Procs(tmp_path)
    env = stack_env(pg_url, redis_url, tmp_path, BATCHD_WORKER_METRICS_HOST="127.0.0.1")
    try:
        procs.start("good", _control("good"), {**env, "BATCHD_WORKER_METRICS_PORT": str(free)})
        procs.start("taken", _control("taken"), {**env, "BATCHD_WORKER_METRICS_PORT": str(taken)})
        procs.wait_log("good", "ready.", 90)
        procs.wait_log("taken", "ready.", 90)  # the worker started without its exporter

        good = _exporter_lines(procs.log("good"))
        assert len(good) == 1, procs.logs()
        assert "INFO" in good[0] and f"listening on http://127.0.0.1:{free}/metrics" in good[0]
        assert httpx.get(f"http://127.0.0.1:{free}/metrics", timeout=5).status_code == 200

        refused = _exporter_lines(procs.log("taken"))
        assert len(refused) == 1, procs.logs()
        assert "ERROR" in refused[0] and f"127.0.0.1:{taken}" in refused[0]
        assert procs.procs["taken"].poll() is None
    finally:
        procs.stop_all(grace_s=10)
        busy.close()


def _exporter_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "metrics exporter" in line]
