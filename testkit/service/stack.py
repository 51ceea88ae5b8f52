"""The whole service as subprocesses, for the end-to-end tests and the benchmarks.

The API under uvicorn, control and model workers and beat (their command lines from
:mod:`core.launch`, their environment), each in its own process group and logging to
``root/<name>.log``; a fresh migrated Postgres database, a private ``redis-server``; waiting
for readiness; the model worker's engine stats over Celery remote control.

The process handling, the engine-stats probe and the memory readings are ``batchd bench``'s
(:mod:`cli.perf.service`); the e2e tests and the benchmarks start the service through this
module, and nothing here imports ``benchmarks``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from cli.perf import service
from cli.perf.service import WorkerProbe, api_up, free_port, wait_for
from core import launch
from core.launch import QUIET
from core.settings import DEMO_MODEL_NAME as MODEL

REPO = Path(__file__).resolve().parents[2]  # the checkout

API_KEY = "sk-e2e-test-key-static"  # the tests' stacks
BENCH_API_KEY = "sk-bench-key-static"  # the benchmarks' stacks
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def api_command(port: int) -> list[str]:
    """The API on loopback ``port``, logging warnings only."""
    return launch.api_command(port, log_level="warning")


def celery_command(
    kind: str, name: str, root: Path, concurrency: int = 2, *, host: str = "e2e"
) -> list[str]:
    """A control worker, a model worker (the demo model's queue) or beat, named
    ``name@host``."""
    if kind == "beat":
        return launch.beat_command(root / f"beat-schedule-{name}", extra=["--loglevel", "INFO"])
    if kind == "control":
        return launch.control_worker_command(f"{name}@{host}", concurrency, extra=QUIET)
    return launch.model_worker_command([MODEL], concurrency, f"{name}@{host}", extra=QUIET)


def stack_env(
    database_url: str, broker_url: str, root: Path, *, api_key: str = API_KEY, **overrides: str
) -> dict[str, str]:
    """The environment of a private service on ``root`` serving the tiny demo model
    (``overrides`` win; engine options in ``BATCHD_ENGINE_OPTIONS`` get ``dtype`` float32
    unless they name one)."""
    (root / "home").mkdir(parents=True, exist_ok=True)
    # The engine in float32 unless a test says otherwise: the tests' oracle is greedy text
    # equal to another run's, which bf16 (the default on a CPU that multiplies it natively)
    # keeps only where both runs batch the same sequences together.
    inherited = os.environ.get("BATCHD_ENGINE_OPTIONS") or "{}"
    options = json.loads(overrides.pop("BATCHD_ENGINE_OPTIONS", inherited))
    options.setdefault("dtype", "float32")
    settings = {
        "BATCHD_ENGINE_OPTIONS": json.dumps(options),
        "BATCHD_API_KEYS": api_key,
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",  # tests and benchmarks poll faster than clients
    }
    models = {MODEL: "demo:llama-tiny"}
    return launch.service_env(root, database_url, broker_url, models, **{**settings, **overrides})


class Procs(service.Procs):
    """The service's processes run from the repository, as the tests start and kill them."""

    def __init__(self, root: Path):
        super().__init__(root, cwd=REPO)


class RedisServer:
    """A private ``redis-server`` on a free port (no queue shared with anyone); without the
    binary, ``fallback_url`` (a database of a shared server), emptied. ``stop()`` ends it.

    A free port is free only until someone binds it: a server started beside another run's
    could lose the port to it, and a check that merely found the port open would then hand
    out the other run's server (two stacks sharing one broker, until that run stops it). So
    the server counts as up only when the one answering on the port is this process's child;
    otherwise it is started again on another port."""

    ATTEMPTS = 5

    def __init__(self, directory: Path, fallback_url: str):
        self._proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            import redis

            redis.Redis.from_url(fallback_url).flushdb()
            self.url = fallback_url
            return
        for attempt in range(1, self.ATTEMPTS + 1):
            port = free_port()
            self._proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(directory)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            self.url = f"redis://127.0.0.1:{port}/0"
            try:
                wait_for(partial(self._answering, port), 15, "the private redis-server")
                return
            except _LostPort:
                self.stop()
                if attempt == self.ATTEMPTS:
                    raise RuntimeError(
                        "the private redis-server did not come up on a port of its own in "
                        f"{self.ATTEMPTS} tries (it exited, or another process held the port)"
                    ) from None
            except BaseException:
                self.stop()
                raise

    def _answering(self, port: int) -> bool:
        """Whether this server answers on ``port``; :class:`_LostPort` if it exited or
        another process answers there."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        proc = self._proc
        assert proc is not None
        if not port_open(port):
            if proc.poll() is not None:
                raise _LostPort
            return False
        try:
            with redis.Redis(
                host="127.0.0.1", port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0)
            ) as client:
                pid = int(client.info("server")["process_id"])
        except Exception:
            if proc.poll() is not None:
                raise _LostPort from None
            return False  # still starting, or not a Redis at all yet
        if pid != proc.pid:
            raise _LostPort
        return True

    @property
    def pid(self) -> int | None:
        """The private server's pid; None on a shared server's database."""
        return None if self._proc is None else self._proc.pid

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)


class _LostPort(Exception):
    """Another process holds the port a private server was started on."""


@contextmanager
def private_redis(redis_url: str, directory: Path) -> Iterator[str]:
    """A private redis-server on a free port (no queue is shared with anyone); without the
    binary, the next database index of ``redis_url``'s server, emptied."""
    base, _, index = redis_url.rpartition("/")
    server = RedisServer(directory, fallback_url=f"{base}/{(int(index) + 1) % 15 + 1}")
    try:
        yield server.url
    finally:
        server.stop()


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
            from core.database.sessions import get_engine

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
    return stack_env(database_url, broker_url, root, api_key=BENCH_API_KEY, **overrides)


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

        return OpenAI(base_url=self.base_url, api_key=BENCH_API_KEY, max_retries=2, **kw)

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
    """Asks one worker for ``engine_stats`` (the remote-control command in worker.infra.runtime)."""

    def __init__(self, broker_url: str, worker: str = "model@bench"):
        super().__init__(broker_url, [worker])
        self.worker = worker

    def __call__(self, timeout: float = 1.0) -> dict[str, Any] | None:
        return self.engine_stats(timeout).get(self.worker)
