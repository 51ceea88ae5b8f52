"""Shared fixtures: a fresh Postgres database per test session (migrated by Alembic), a Redis
database, storage directories and settings pointing at them. Real servers, real connections."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_HOST = os.environ.get("BATCHD_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("BATCHD_TEST_PG_PORT", "5432"))
PG_ADMIN_URL = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/postgres"
REDIS_HOST = os.environ.get("BATCHD_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("BATCHD_TEST_REDIS_PORT", "6379"))
STATIC_TEST_KEY = "sk-test-static"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh, migrated Postgres database for this test session; dropped afterwards."""
    if not _reachable(PG_HOST, PG_PORT):
        pytest.fail(f"Postgres is not reachable at {PG_HOST}:{PG_PORT}; start it (see .ci/run)")
    from sqlalchemy import create_engine, text

    import migrations

    name = f"batchd_test_{os.getpid()}_{secrets.token_hex(3)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/{name}"
    migrations.upgrade(url)
    try:
        yield url
    finally:
        from core.db import get_engine

        for engine_url in (url, None):
            with contextlib.suppress(Exception):
                get_engine(engine_url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis database index picked for this session and emptied first."""
    if not _reachable(REDIS_HOST, REDIS_PORT):
        pytest.fail(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}; start it (see .ci/run)")
    import redis

    # BATCHD_TEST_REDIS_DB pins the index, so test runs side by side on one server stay apart.
    index = int(os.environ.get("BATCHD_TEST_REDIS_DB") or 1 + secrets.randbelow(15))
    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{index}"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Demo models are cached across runs under the user's cache (they are deterministic)."""
    from engine.demo_models import cache_root

    return cache_root()


@pytest.fixture
def service_env(
    pg_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """BATCHD_* variables for a service on real Postgres, Redis and a fresh storage directory."""
    from core.settings import get_settings

    env = {
        "BATCHD_HOME": str(tmp_path / "home"),
        "BATCHD_DATABASE_URL": pg_url,
        "BATCHD_BROKER_URL": redis_url,
        "BATCHD_STORAGE_URL": str(tmp_path / "storage"),
        # A static key for tenant "default" (the API requires a key by default), sent by the
        # batchd client commands too; no per-key rate limit so tests can poll freely.
        "BATCHD_API_KEYS": STATIC_TEST_KEY,
        "BATCHD_API_KEY": STATIC_TEST_KEY,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()
