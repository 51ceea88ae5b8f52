"""The worker's log stays readable: the periodic sweeps' per-tick Celery lines are DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from worker.infra.celery import quiet_housekeeping_logs

SWEEP = "batchd.release_shards"


@pytest.fixture
def quiet() -> Iterator[None]:
    from worker.infra.celery import _TASK_LIFECYCLE_LOGGERS

    saved = {name: list(logging.getLogger(name).filters) for name in _TASK_LIFECYCLE_LOGGERS}
    quiet_housekeeping_logs({SWEEP})
    yield
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = filters


def test_sweep_ticks_are_debug(quiet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    beat = logging.getLogger("celery.beat")
    strategy = logging.getLogger("celery.worker.strategy")
    trace = logging.getLogger("celery.app.trace")
    beat.info("Scheduler: Sending due task %s (%s)", "release-shards", SWEEP)
    strategy.info("Task %(name)s[%(id)s] received", {"name": SWEEP, "id": "1"})
    trace.info(
        "Task %(name)s[%(id)s] succeeded in %(runtime)ss",
        {"name": SWEEP, "id": "1", "runtime": 0.1},
    )
    assert caplog.records == []

    # Real work and failures stay visible.
    strategy.info("Task %(name)s[%(id)s] received", {"name": "batchd.validate", "id": "2"})
    trace.error("Task %(name)s[%(id)s] raised", {"name": SWEEP, "id": "3"})
    assert [r.levelname for r in caplog.records] == ["INFO", "ERROR"]


def test_debug_shows_sweep_ticks(quiet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger("celery.beat").info("Scheduler: Sending due task x (%s)", SWEEP)
    assert [r.levelname for r in caplog.records] == ["DEBUG"]


def test_the_worker_app_quiets_every_scheduled_sweep() -> None:
    from worker.infra.celery import _TASK_LIFECYCLE_LOGGERS, app

    scheduled = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert SWEEP in scheduled
    for name in _TASK_LIFECYCLE_LOGGERS:
        filters = logging.getLogger(name).filters
        assert any(getattr(f, "task_names", None) == frozenset(scheduled) for f in filters)
