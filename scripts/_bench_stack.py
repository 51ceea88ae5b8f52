"""Helpers the service benchmarks share: a fresh Postgres database, a private Redis, the
service's processes (API under uvicorn, control worker, model worker, beat) as subprocesses
logging to a directory, the model worker's engine stats over Celery remote control, and the
resident memory of a process from ``/proc``.

The processes, their command lines and environment come from ``tests/helpers/service.py``,
the module the e2e tests start the service with, and the process handling, the engine-stats
probe and the memory readings from ``cli/perf/service.py`` (``batchd bench``'s): real
servers, real connections, one process group per service process so stopping it stops
everything it started.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cli.perf.service import (  # noqa: E402 - needs the repository on the path
    WorkerProbe,
    api_up,
    memory_kb,
)
from tests.helpers.service import (  # noqa: E402
    MODEL,
    Procs,
    RedisServer,
    api_command,
    celery_command,
    free_port,
    stack_env,
    wait_for,
)

__all__ = ["MODEL", "free_port", "memory_kb", "wait_for"]

API_KEY = "sk-bench-key"
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Database:
    """A fresh database on the local Postgres server, migrated; ``drop()`` removes it."""

    def __init__(
        self, admin_url: str = PG_ADMIN_URL, prefix: str = "batchd_bench", migrate: Path = REPO
    ):
        """Migrated by the migrations of the tree ``migrate`` (this repository by default)."""
        from sqlalchemy import create_engine, text

        import migrations

        self.name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
        self._admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        self.url = admin_url.rsplit("/", 1)[0] + f"/{self.name}"
        if Path(migrate).resolve() == REPO:
            migrations.upgrade(self.url)
        else:
            code = f"import migrations; migrations.upgrade({self.url!r})"
            subprocess.run([sys.executable, "-c", code], cwd=migrate, check=True)

    def drop(self) -> None:
        from sqlalchemy import text

        try:
            from core.db import get_engine

            get_engine(self.url).dispose()
        except Exception:
            pass
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()


def Broker(root: Path, fallback_url: str = REDIS_URL) -> RedisServer:
    """A private ``redis-server`` on a free port; without the binary, a random database index
    of the local Redis (``fallback_url``'s server) that this run empties first."""
    base, _, _index = fallback_url.rpartition("/")
    return RedisServer(root, fallback_url=f"{base}/{1 + secrets.randbelow(15)}")


def service_env(root: Path, database_url: str, broker_url: str, **overrides: str) -> dict[str, str]:
    """The environment of a private service on ``root`` (``overrides`` win), its engine in the
    dtype it would choose itself (the tests' stacks pin float32)."""
    inherited = os.environ.get("BATCHD_ENGINE_OPTIONS") or "{}"
    options = json.loads(overrides.get("BATCHD_ENGINE_OPTIONS") or inherited)
    options.setdefault("dtype", "auto")
    overrides["BATCHD_ENGINE_OPTIONS"] = json.dumps(options)
    return stack_env(database_url, broker_url, root, api_key=API_KEY, **overrides)


class Stack(Procs):
    """The service's processes on ``port``, each logging to ``root/<name>.log``."""

    def __init__(self, root: Path, env: dict[str, str], port: int):
        super().__init__(root)
        self.env = env
        self.port = port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start_roles(self, roles: Iterable[str], shard_concurrency: int = 4) -> Stack:
        """Start ``roles`` (api, control, model, beat) as ``python -m worker`` runs them."""
        for name in roles:
            if name == "api":
                cmd = api_command(self.port)
            else:
                concurrency = shard_concurrency if name == "model" else 2
                cmd = celery_command(name, name, self.root, concurrency, host="bench")
            self.start(name, cmd, self.env)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """The API answers, the control worker is ready, the model worker has its model."""

        def ready() -> bool:
            self.check_alive()
            if "api" in self.procs and not api_up(self.port):
                return False
            if "control" in self.procs and "ready." not in self.log("control"):
                return False
            return "model" not in self.procs or f"model {MODEL} ready" in self.log("model")

        wait_for(ready, timeout, "the service to start", self.logs)

    def client(self, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=2, **kw)

    def stop(self) -> None:
        self.stop_all()


def upload_and_create(client: Any, path: Path, endpoint: str) -> tuple[Any, float]:
    """Upload ``path`` with the ``openai`` client and create a batch on it: (the batch, when
    the upload ended, ``time.monotonic()``)."""
    with path.open("rb") as fh:
        uploaded = client.files.create(file=(path.name, fh), purpose="batch")
    upload_done = time.monotonic()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )
    return batch, upload_done


class Run:
    """One benchmark run's service in ``work``: a fresh database and a private broker on
    entering, the stack once :meth:`stack` starts it; leaving the ``with`` stops and removes
    all of it (``work`` too, unless ``keep``)."""

    def __init__(
        self, work: Path, pg_admin_url: str = PG_ADMIN_URL, redis_url: str = REDIS_URL, *,
        keep: bool = False,
    ):  # fmt: skip
        self.work = work
        self.keep = keep
        self._pg_admin_url = pg_admin_url
        self._redis_url = redis_url
        self.db: Database | None = None
        self.broker: RedisServer | None = None
        self._stack: Stack | None = None

    def __enter__(self) -> Run:
        try:
            self.db = Database(self._pg_admin_url)
            self.broker = Broker(self.work, self._redis_url)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, **overrides: str) -> dict[str, str]:
        """The service's environment on this run's database and broker."""
        if self.db is None or self.broker is None:
            raise RuntimeError("the run's database and broker start on entering it")
        return service_env(self.work, self.db.url, self.broker.url, **overrides)

    def stack(self, env: dict[str, str]) -> Stack:
        """The service's processes on a free port, stopped when the run ends."""
        self._stack = Stack(self.work, env, free_port())
        return self._stack

    def close(self) -> None:
        if self._stack is not None:
            self._stack.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.db is not None:
            self.db.drop()
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


class EngineStatsProbe(WorkerProbe):
    """Asks one worker for ``engine_stats`` (the remote-control command in worker.runtime)."""

    def __init__(self, broker_url: str, worker: str = "model@bench"):
        super().__init__(broker_url, [worker])
        self.worker = worker

    def __call__(self, timeout: float = 1.0) -> dict[str, Any] | None:
        return self.engine_stats(timeout).get(self.worker)
