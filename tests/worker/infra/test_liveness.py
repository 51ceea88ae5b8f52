"""The worker's liveness watchdog (worker/infra/liveness.py) with a stand-in consumer: it
touches the file while the loop turns or the consumer reconnects, and ends the process
(non-zero) once the loop has stalled or an engine host died; ``python -m worker health``
reads the file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import bootsteps

import worker.__main__ as worker_main
from core import launch
from worker.infra import liveness

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
        assert worker_main.file_age_s(tmp_path / "alive") < 1
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
    from worker.infra import runtime

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
    assert liveness.start(SimpleNamespace(hub=None), frozenset()) is None


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
        launch.worker_module_command("health"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert proc.stdout.startswith("healthy: " if expected == 0 else "unhealthy: ")


# The control pool: every thread stuck inside a task while the loop turns.

BUSY = liveness.PoolSnapshot(
    running=frozenset({"a", "b"}), waiting=1, started=7, busy=2, size=2, names=("v", "f")
)


def test_a_pool_that_makes_no_progress_is_a_stall() -> None:
    stall = liveness.pool_stall
    assert stall(BUSY, idle_s=601, timeout_s=600) is not None
    assert stall(BUSY, idle_s=599, timeout_s=600) is None  # not for long enough
    assert stall(BUSY, idle_s=10**6, timeout_s=0) is None  # 0: never
    # A thread free and nothing waiting: the pool still takes the next task.
    one_slow = liveness.PoolSnapshot(running=frozenset({"a"}), started=7, busy=1, size=2)
    assert stall(one_slow, idle_s=10**6, timeout_s=600) is None
    # No thread free (the rest run other work, as in `batchd up`'s one worker): nothing can
    # start, whether or not the consumer holds a waiting task.
    full = liveness.PoolSnapshot(running=frozenset({"a"}), started=7, busy=10, size=10)
    assert stall(full, idle_s=601, timeout_s=600) is not None
    assert stall(liveness.PoolSnapshot(waiting=3, size=2), idle_s=10**6, timeout_s=600) is None
    why = stall(BUSY, idle_s=601, timeout_s=600)
    assert "601s" in why and "worker_stall_timeout_s=600" in why and "f, v" in why


def test_progress_is_a_control_task_starting_or_finishing() -> None:
    assert liveness.progressed(None, BUSY)
    assert not liveness.progressed(BUSY, BUSY)
    started = liveness.PoolSnapshot(running=BUSY.running | {"c"}, started=8, busy=2, size=2)
    assert liveness.progressed(BUSY, started)
    finished = liveness.PoolSnapshot(running=frozenset({"a"}), waiting=1, started=7, size=2)
    assert liveness.progressed(BUSY, finished)


def test_a_stalled_control_pool_ends_the_worker_naming_why(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    snapshots = [BUSY]
    monkeypatch.setattr(liveness, "pool_snapshot", lambda consumer, names: snapshots[-1])
    exits: list[int] = []
    dog = liveness.Watchdog(
        _consumer(), path=str(tmp_path / "alive"), interval_s=0.05, hang_timeout_s=0,
        stall_timeout_s=600, exit=exits.append,
    )  # fmt: skip
    assert dog.check() and exits == []
    dog.last_progress -= 300
    assert dog.check() and exits == []  # stuck, but not for long enough
    snapshots.append(
        liveness.PoolSnapshot(running=frozenset({"b", "c"}), started=8, busy=2, size=2)
    )
    dog.last_progress -= 3600
    assert dog.check() and exits == []  # a task finished and another started: progress
    dog.last_progress -= 601
    with caplog.at_level("CRITICAL", logger="worker.infra.liveness"):
        assert not dog.check()
    assert exits == [liveness.EXIT_UNHEALTHY]
    assert "no control task has started or finished" in caplog.text


def test_the_snapshot_reads_celerys_worker_state() -> None:
    from celery.worker import state

    class Request:  # what Celery's state keeps (weakly): an id and a task name
        def __init__(self, id: str, name: str) -> None:
            self.id, self.name = id, name

    control = frozenset({"batchd.validate_batch"})
    before = liveness.pool_snapshot(SimpleNamespace(pool=SimpleNamespace(num_processes=2)), control)
    running, waiting, shard = (
        Request("r1", "batchd.validate_batch"),
        Request("r2", "batchd.validate_batch"),
        Request("r3", "batchd.run_shard"),
    )
    try:
        for request in (running, shard):
            state.task_reserved(request)
            state.task_accepted(request)
        state.task_reserved(waiting)
        snap = liveness.pool_snapshot(
            SimpleNamespace(pool=SimpleNamespace(num_processes=2)), control
        )
    finally:
        for request in (running, waiting, shard):
            state.task_ready(request)
    assert snap.running == {"r1"} and snap.waiting == 1
    assert snap.busy == 2 and snap.size == 2 and snap.started == before.started + 1
