"""The worker's liveness watchdog (worker/liveness.py) with a stand-in consumer: it touches the
file while the loop turns or the consumer reconnects, and ends the process (non-zero) once the
loop has stalled or an engine host died; ``python -m worker health`` reads the file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import bootsteps

from worker import liveness

REPO = Path(__file__).resolve().parents[2]


def _consumer(connection: object = "connected", state: int = bootsteps.RUN) -> SimpleNamespace:
    return SimpleNamespace(
        hub=SimpleNamespace(on_tick=set()),
        connection=connection,
        blueprint=SimpleNamespace(state=state),
    )


def _watchdog(tmp_path: Path, consumer: SimpleNamespace, hang_s: float = 0.3):
    exits: list[int] = []
    dog = liveness.Watchdog(
        consumer,
        path=str(tmp_path / "alive"),
        interval_s=0.05,
        hang_timeout_s=hang_s,
        exit=exits.append,
    )
    return dog, exits


def test_a_turning_loop_keeps_the_file_fresh_and_a_stalled_one_exits(tmp_path: Path) -> None:
    consumer = _consumer()
    dog, exits = _watchdog(tmp_path, consumer)
    dog.start()
    try:
        assert dog.tick in consumer.hub.on_tick
        for _ in range(8):  # busy or idle, the loop turns: healthy
            for tick in consumer.hub.on_tick:
                tick()
            time.sleep(0.05)
        assert exits == []
        assert liveness.file_age_s(tmp_path / "alive") < 1
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:  # the loop stops turning
            time.sleep(0.05)
        assert exits == [liveness.EXIT_UNHEALTHY]
    finally:
        dog.stop()


def test_reconnecting_to_the_broker_is_no_hang(tmp_path: Path) -> None:
    dog, exits = _watchdog(tmp_path, _consumer(connection=None))
    dog.last_tick -= 60  # no turn for a minute: the consumer waits for the broker
    assert dog.check() and exits == []
    stalled, exits = _watchdog(tmp_path, _consumer())
    stalled.last_tick -= 60
    assert not stalled.check() and exits == [liveness.EXIT_UNHEALTHY]


def test_a_dead_engine_host_ends_the_worker(tmp_path: Path, monkeypatch) -> None:
    from worker import runtime

    hosts = {"m": SimpleNamespace(is_alive=True)}
    monkeypatch.setattr(runtime, "loaded_hosts", lambda: dict(hosts))
    dog, exits = _watchdog(tmp_path, _consumer(), hang_s=0)  # 0: no hang limit
    dog.last_tick -= 3600
    assert dog.check() and exits == []
    hosts["m"] = SimpleNamespace(is_alive=False)
    assert not dog.check() and exits == [liveness.EXIT_UNHEALTHY]


def test_a_requested_shutdown_stops_the_watchdog(tmp_path: Path) -> None:
    dog, exits = _watchdog(tmp_path, _consumer())
    dog.stop()
    dog.last_tick -= 60
    assert dog.check() and exits == []


def test_no_event_loop_no_watchdog() -> None:
    assert liveness.start(SimpleNamespace(hub=None)) is None


@pytest.mark.parametrize(
    ("age_s", "expected"), [(None, 1), (1.0, 0), (600.0, 1)], ids=["missing", "fresh", "stale"]
)
def test_health_command(tmp_path: Path, age_s: float | None, expected: int) -> None:
    path = tmp_path / "alive"
    if age_s is not None:
        path.touch()
        then = time.time() - age_s
        os.utime(path, (then, then))
    env = {**os.environ, "BATCHD_WORKER_LIVENESS_FILE": str(path)}
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "health"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert proc.stdout.startswith("healthy: " if expected == 0 else "unhealthy: ")
