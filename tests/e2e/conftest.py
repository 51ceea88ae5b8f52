"""The whole service, for real: the API under uvicorn, a control worker, a model worker and
beat as subprocesses on Postgres, Redis and a local storage directory, serving the tiny demo
model. Started once per test module; tests talk to it with the official ``openai`` client.

The processes, their command lines and environment come from :mod:`testkit.service.stack`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL
from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import MODEL_WORKER_GATE, FileGate, closed_gate
from testkit.service.stack import (
    API_KEY,
    Procs,
    api_command,
    celery_command,
    private_redis,
    stack_env,
)


@dataclass
class Stack:
    base_url: str
    env: dict[str, str]
    root: Path
    client: Any  # openai.OpenAI

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def gate(self, name: str) -> AbstractContextManager[FileGate]:
        """A gate in the model worker's engine, closed for the block: a line whose prompt
        carries ``gate.marker`` holds the engine once admitted (and cannot finish), so its
        batch is still running when the test acts, however fast the machine
        (:mod:`testkit.engine_gate`)."""
        return closed_gate(Path(self.env[GATE_ENV]), name)


def _own_redis_db(redis_url: str) -> str:
    """A Redis database index of its own, so queues never mix with other tests' messages."""
    base, _, index = redis_url.rpartition("/")
    mine = (int(index) % 15) + 1
    return f"{base}/{mine}"


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest,
    pg_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """The service, with the module's ``STACK_ENV`` (if any) added to its environment."""
    import httpx
    import redis
    from openai import OpenAI

    from core.llms.demo import build

    build("llama-tiny")  # once, before two processes race to build it
    root = tmp_path_factory.mktemp("e2e")
    broker = _own_redis_db(redis_url)
    redis.Redis.from_url(broker).flushdb()
    port = free_port()
    env = stack_env(
        pg_url,
        broker,
        root,
        BATCHD_CHECKPOINT_EVERY="4",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS="16",
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
        # A small running batch, in arrival order (not longest-first): the requests at the
        # head finish first, and a gated line at the end is admitted last.
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4, "admission": "fcfs"}),
        **{GATE_ENV: str(root / "gates")},
        **getattr(request.module, "STACK_ENV", {}),
    )
    procs = Procs(root)
    try:
        procs.start("api", api_command(port), env)
        procs.start("control", celery_command("control", "control", root), env)
        procs.start("model", [*celery_command("model", "model", root), *MODEL_WORKER_GATE], env)
        procs.start("beat", celery_command("beat", "beat", root), env)
        stack = Stack(
            f"http://127.0.0.1:{port}/v1",
            env,
            root,
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0),
        )

        def api_up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        def ready() -> bool:
            procs.check_alive()
            return (
                api_up()
                and "ready." in procs.log("control")
                and f"model {MODEL} ready" in procs.log("model")
            )

        wait_for(ready, 120, "the API, the workers and the model", procs.logs)
        yield stack
    finally:
        procs.stop_all()


# ---------------------------------------------------------------------------------------------
# Processes a test starts, kills and restarts itself (crash recovery and outage tests).


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    from core.llms.demo import build

    build("llama-tiny")  # once, before several processes race to build it
    manager = Procs(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all(grace_s=10)


@pytest.fixture
def private_broker(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """A private broker for this test (see :func:`private_redis`)."""
    with private_redis(redis_url, tmp_path) as url:
        yield url
