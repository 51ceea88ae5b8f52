"""The command lines of the service's processes, built in one place.

The API, the control worker, a model or dispatch worker and beat, each as an argv list. Every
launcher builds its processes here: ``python -m worker`` (and compose), ``batchd up``,
``batchd bench``, the benchmarks' stacks, the soak and the tests. Pure: it reads no settings
and starts nothing (what differs between launchers comes in as arguments), and names modules
only as strings, so importing it imports neither the API nor the worker."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from core.broker.queue import CONTROL_QUEUE, model_queue

API_APP = "api.app:app"
CELERY_APP = "worker.infra.celery"

# The options of the workers that the benchmarks and tests start: INFO lines (they read
# readiness from them) and none of the chatter (gossip, mingle, event heartbeats) that many
# short-lived workers on one broker would exchange.
QUIET = ("--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat")

# The control worker's pool: validate, finalize, cancel and the sweeps are short, and two
# threads keep one slow finalize from holding up the rest.
CONTROL_CONCURRENCY = 2


def node_name(prefix: str) -> str:
    """A Celery node name unique on this host: ``prefix-<pid>@%h``."""
    return f"{prefix}-{os.getpid()}@%h"


def api_command(
    port: int = 8000,
    host: str = "127.0.0.1",
    *,
    workers: int = 1,
    log_level: str | None = None,
) -> list[str]:
    """The API under uvicorn on ``host:port``; with ``workers`` > 1, uvicorn's own process
    manager runs that many processes on the one socket (and starts again one that dies)."""
    cmd = [sys.executable, "-m", "uvicorn", API_APP, "--host", host, "--port", str(port)]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    if log_level is not None:
        cmd += ["--log-level", log_level]
    return cmd


def celery_command(*args: str) -> list[str]:
    """``celery -A worker.infra.celery`` with ``args``: a program of the worker's Celery app."""
    return [sys.executable, "-m", "celery", "-A", CELERY_APP, *args]


def worker_command(
    queues: Iterable[str],
    concurrency: int,
    name: str,
    *,
    pool: str = "threads",
    extra: Iterable[str] = (),
) -> list[str]:
    """A Celery worker that consumes ``queues`` with ``concurrency`` tasks in flight on
    ``pool`` (threads: the engine loads once per process, and nothing forks after CUDA is
    initialised), named ``name``; ``extra`` options last."""
    return celery_command(
        "worker", "-Q", ",".join(queues), "--pool", pool, "-c", str(concurrency), "-n", name,
        *extra,
    )  # fmt: skip


def control_worker_command(
    name: str,
    concurrency: int = CONTROL_CONCURRENCY,
    *,
    pool: str = "threads",
    extra: Iterable[str] = (),
) -> list[str]:
    """The control worker: validate, finalize, cancel and the sweeps (the webhook queue is
    consumed by every control worker on threads of its own, :mod:`worker.batches.webhooks`)."""
    return worker_command([CONTROL_QUEUE], concurrency, name, pool=pool, extra=extra)


def model_worker_command(
    models: Iterable[str], concurrency: int, name: str, *, extra: Iterable[str] = ()
) -> list[str]:
    """A model worker for the served ``models``: their queues, ``concurrency`` shard tasks in
    flight on threads that feed the one engine per model."""
    return worker_command([model_queue(m) for m in models], concurrency, name, extra=extra)


def control_and_model_worker_command(
    models: Iterable[str], concurrency: int, name: str, *, extra: Iterable[str] = ()
) -> list[str]:
    """One worker for everything, as ``batchd up`` runs it on one machine: the control queue
    and the queues of the served ``models``, ``concurrency`` tasks in flight."""
    queues = [CONTROL_QUEUE, *(model_queue(m) for m in models)]
    return worker_command(queues, concurrency, name, extra=extra)


def dispatch_worker_command(
    models: Iterable[str], concurrency: int, name: str, *, extra: Iterable[str] = ()
) -> list[str]:
    """A dispatch worker for the upstream ``models``: their queues (an upstream model's queue
    is a model queue too), ``concurrency`` shard tasks in flight; no engine, no torch."""
    return worker_command([model_queue(m) for m in models], concurrency, name, extra=extra)


def beat_command(schedule: str | Path, *, extra: Iterable[str] = ()) -> list[str]:
    """Beat, the scheduler of the sweeps, keeping its schedule in the file ``schedule``."""
    return celery_command("beat", "-s", str(schedule), *extra)


def worker_module_command(
    role: str, names: Iterable[str] = (), *, extra: Iterable[str] = ()
) -> list[str]:
    """``python -m worker role [NAME…] -- extra``: a worker as compose starts it, its queues
    and concurrency resolved from the settings in its environment (:mod:`worker.__main__`)."""
    extra = list(extra)
    return [sys.executable, "-m", "worker", role, *names, *(["--", *extra] if extra else [])]


def service_env(
    root: Path,
    database_url: str,
    broker_url: str,
    models: Mapping[str, str],
    *,
    base: Mapping[str, str] | None = None,
    **overrides: str,
) -> dict[str, str]:
    """The environment of a private service whose files live under ``root`` (``home/``,
    ``storage/``), on the given database and broker, serving ``models``; ``base`` (default:
    this process's environment) under it and ``overrides`` over it."""
    return {
        **(os.environ if base is None else base),
        "PYTHONUNBUFFERED": "1",
        "BATCHD_HOME": str(root / "home"),
        "BATCHD_DATABASE_URL": database_url,
        "BATCHD_BROKER_URL": broker_url,
        "BATCHD_STORAGE_URL": str(root / "storage"),
        "BATCHD_MODELS": json.dumps(dict(models)),
        **overrides,
    }
