"""Shared fixtures: a fresh Postgres database per test session (migrated by Alembic), a Redis
database, storage directories and settings pointing at them. Real servers, real connections."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_HOST = os.environ.get("BATCHD_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("BATCHD_TEST_PG_PORT", "5432"))
PG_ADMIN_URL = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/postgres"
REDIS_HOST = os.environ.get("BATCHD_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("BATCHD_TEST_REDIS_PORT", "6379"))
STATIC_TEST_KEY = "sk-test-static-key"


# Under pytest-xdist (scripts/test.sh runs the suite on two workers, one test module per
# worker at a time), the modules that take longest start first, so that no worker is left
# with a long module at the end while the other has nothing to do: the end-to-end modules
# (whole service stacks, mostly waiting on their subprocesses), then the engine's (CPU-bound),
# then the rest in their usual order.
FIRST = ["tests/e2e/test_soak.py", "tests/e2e/", "tests/engine/attention/test_model_families.py",
         "tests/engine/", "tests/cli/", "tests/api/"]  # fmt: skip


def _worker_threads() -> None:
    """On an xdist worker, torch (here and in the service processes the tests start) gets the
    cores divided by the workers, not every core each: on two busy cores two OpenMP threads
    per process stall at every barrier (an engine test measured 10x slower). Set when this
    file is imported, before the directories' conftest files import torch, and applied to a
    torch already imported; ``OMP_NUM_THREADS`` set by hand wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


_worker_threads()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # a plain run keeps pytest's order

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, p in enumerate(FIRST) if path.startswith(p)), len(FIRST))

    items.sort(key=rank)  # stable: modules and the tests in each keep their order


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
        from core.database.sessions import get_engine

        for engine_url in (url, None):
            with contextlib.suppress(Exception):
                get_engine(engine_url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def redis_index() -> int:
    """The Redis database index of this test session, 1 to 15 (0 is left to ``benchmarks.soak``
    and the service scripts). ``BATCHD_TEST_REDIS_DB`` pins it, so test runs side by side on
    one server stay apart; otherwise it is random. Under pytest-xdist every worker of a run
    takes its own: the run's index (pinned, or drawn from the run's id) plus three per worker,
    since a session also uses the next two indices (the e2e stack's broker, and a private
    broker's fallback without ``redis-server``). Five workers fit in the 15 indices.

    So a run pinned to P with W workers (W = 1 without xdist) uses the indices P to
    P + 3W - 1, wrapping from 15 back to 1: worker N takes P + 3N, P + 3N + 1 and P + 3N + 2.
    Two runs side by side stay apart only if their ranges do not overlap: pinned 1 and 4 with
    two workers each collide (the first run's worker 1 is the second run's worker 0)."""
    pinned = os.environ.get("BATCHD_TEST_REDIS_DB")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return int(pinned) if pinned else 1 + secrets.randbelow(15)
    if pinned:
        base = int(pinned)
    else:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
        base = 1 + int(hashlib.sha256(run.encode()).hexdigest(), 16) % 15
    return (base - 1 + 3 * int(worker.removeprefix("gw"))) % 15 + 1


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis database index picked for this session and emptied first."""
    if not _reachable(REDIS_HOST, REDIS_PORT):
        pytest.fail(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}; start it (see .ci/run)")
    import redis

    url = f"redis://{REDIS_HOST}:{REDIS_PORT}/{redis_index()}"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Demo models are cached across runs under the user's cache (they are deterministic)."""
    from core.llms.demo import cache_root

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
