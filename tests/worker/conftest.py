"""Fixtures for the worker tests: settings serving the tiny demo model, an in-process engine
host on it (real engine, real Postgres, real local storage), and helpers to create batches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.builders.worker import MODEL


@pytest.fixture
def worker_env(
    service_env: dict[str, str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """``service_env`` plus the tiny model, small checkpoints, and the Celery app's broker
    pointed at the test Redis (so tasks the code sends land somewhere we can inspect)."""
    from core.settings import get_settings
    from worker.infra.celery import app

    extra = {
        "BATCHD_MODELS": json.dumps({MODEL: "demo:llama-tiny"}),
        "BATCHD_CHECKPOINT_EVERY": "4",
        "BATCHD_CHECKPOINT_INTERVAL_S": "60",
    }
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    old_broker = app.conf.broker_url
    app.conf.broker_url = redis_url
    yield {**service_env, **extra}
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.keys("batchd.*"):
        client.delete(key)
    app.conf.broker_url = old_broker
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def host() -> Iterator[Any]:
    """One engine host on the tiny model for the whole session (as in a model worker)."""
    from core.llms.demo import build
    from engine import Engine, EngineHost

    h = EngineHost(Engine(str(build("llama-tiny")))).start()
    yield h
    h.shutdown(wait=True, abort_pending=True, timeout=30)


@pytest.fixture
def storage_root(worker_env: dict[str, str]) -> Path:
    return Path(worker_env["BATCHD_STORAGE_URL"])
