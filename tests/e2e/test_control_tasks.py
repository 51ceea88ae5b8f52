"""No control-task failure strands a batch, and a batch with nothing left to run completes.

Real subprocesses on Postgres, a private Redis and a local storage directory: a control
worker that loads the test-only fault module ``control_faults`` (``celery worker -I``), a
model worker serving the tiny demo model, and beat. Validates and finalizes that raise are
retried with backoff and then fail the batch with the error named; a batch whose validate
was lost is sent again by the reclaim sweep; a finalize that runs past ``expires_at`` (the
control worker was frozen meanwhile) still completes a batch whose every request ran."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import wait_for
from testkit.builders.lines import MODEL
from testkit.builders.worker import batch_row, chat_line, make_batch, read_file_lines
from testkit.service.stack import Procs, celery_command, private_redis, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
MAX_ATTEMPTS = 3
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Service:
    def __init__(self, procs: Procs, broker: str, faults: Path):
        self.procs = procs
        self.broker = broker
        self.faults = faults

    def submit(self, n: int = 4, fault: str | None = None, enqueue: bool = True) -> str:
        """Create a batch of ``n`` short chat requests (with ``fault`` for control_faults)
        and send its validate, as the API does."""
        from core.broker.queue import TASK_VALIDATE
        from core.broker.queue import enqueue as send

        batch_id = make_batch([chat_line(f"r{i}", f"count to {i}", max_tokens=4) for i in range(n)])
        if fault is not None:
            (self.faults / batch_id).write_text(fault)
        if enqueue:
            send(TASK_VALIDATE, batch_id, broker_url=self.broker)
        return batch_id

    def wait(self, batch_id: str, timeout: float, until=lambda b: b.status in TERMINAL) -> Any:
        found: list[Any] = []

        def done() -> bool:
            found[:] = [batch_row(batch_id)]
            return until(found[0])

        wait_for(done, timeout, f"batch {batch_id}", self.procs.logs)
        return found[0]

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.procs.procs[name].pid, sig)


@pytest.fixture(scope="module")
def service(
    pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    from core.llms.demo import build
    from core.settings import get_settings

    build("llama-tiny")  # once, before two processes race to build it
    root = tmp_path_factory.mktemp("control-tasks")
    faults = root / "faults"
    faults.mkdir()
    with private_redis(redis_url, root) as broker, pytest.MonkeyPatch.context() as mp:
        env = stack_env(
            pg_url,
            broker,
            root,
            BATCHD_CHECKPOINT_EVERY="4",
            BATCHD_CHECKPOINT_INTERVAL_S="0.5",
            BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
            BATCHD_RECLAIM_SWEEP_INTERVAL_S="1",
            BATCHD_STUCK_BATCH_AFTER_S="4",
            BATCHD_CONTROL_TASK_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
            BATCHD_CONTROL_TASK_RETRY_DELAY_S="0.5",
            BATCHD_TEST_FAULT_DIR=str(faults),
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        )
        # This process creates batches and reads results on the same database and storage.
        for key in ("BATCHD_DATABASE_URL", "BATCHD_STORAGE_URL", "BATCHD_BROKER_URL"):
            mp.setenv(key, env[key])
        get_settings.cache_clear()
        procs = Procs(root)
        try:
            procs.start(
                "control",
                [*celery_command("control", "control", root), "-I", "control_faults"],
                env,
            )
            procs.start("model", celery_command("model", "model", root), env)
            procs.start("beat", celery_command("beat", "beat", root), env)
            procs.wait_log("control", "ready.", 180)
            procs.wait_log("model", f"model {MODEL} ready", 180)
            yield Service(procs, broker, faults)
        finally:
            procs.stop_all()
            get_settings.cache_clear()


def _ids(file_id: str | None) -> list[str]:
    return [r["custom_id"] for r in read_file_lines(file_id)]


def test_validate_that_fails_once_is_retried_and_the_batch_completes(service):
    batch_id = service.submit(fault="validate:once")
    batch = service.wait(batch_id, 120)
    assert batch.status == "completed", (batch.status, batch.errors)
    assert _ids(batch.output_file_id) == [f"r{i}" for i in range(4)]
    log = service.procs.log("control")
    assert log.count(f"injected fault: validate of {batch_id}") == 1
    assert f"validate batch {batch_id} failed (run 1 of {MAX_ATTEMPTS})" in log
    # The worker's start imported transformers' Auto classes before any task ran.
    assert (
        "auto classes before the first validate: "
        "['AutoConfig', 'AutoTokenizer', 'AutoModelForCausalLM', 'AutoModel']" in log
    )


def test_validate_that_always_fails_fails_the_batch_with_the_error_named(service):
    batch_id = service.submit(fault="validate:always")
    started = time.monotonic()
    batch = service.wait(batch_id, 60)
    took = time.monotonic() - started
    assert batch.status == "failed", (batch.status, batch.errors)
    (error,) = batch.errors
    assert error["code"] == "server_error" and error["line"] is None
    assert error["message"].startswith(f"Validating the batch failed {MAX_ATTEMPTS} times")
    assert f"RuntimeError: injected validate fault (call {MAX_ATTEMPTS})" in error["message"]
    # Retries after about 0.5 s and 1 s (with jitter): well inside the bound, not the window.
    assert took < 30, took
    assert service.procs.log("control").count(f"injected fault: validate of {batch_id}") >= 3


def test_finalize_that_always_fails_fails_the_batch_with_the_error_named(service):
    batch_id = service.submit(fault="finalize:always")
    batch = service.wait(batch_id, 120)
    assert batch.status == "failed", (batch.status, batch.errors)
    assert batch.finalizing_at is not None  # every shard ran; the finalize kept failing
    (error,) = batch.errors
    assert error["code"] == "server_error"
    assert error["message"].startswith(f"Finalizing the batch failed {MAX_ATTEMPTS} times")
    assert "RuntimeError: injected finalize fault" in error["message"]


def test_batch_left_validating_without_a_task_is_sent_again_by_the_sweep(service):
    batch_id = service.submit(enqueue=False)  # as if its validate message had been lost
    batch = service.wait(batch_id, 90)
    assert batch.status == "completed", (batch.status, batch.errors)
    assert _ids(batch.output_file_id) == [f"r{i}" for i in range(4)]
    assert f"batch {batch_id} has been validating for over 4s" in service.procs.log("control")


def test_finalize_after_the_window_completes_a_batch_whose_requests_all_ran(service):
    """The control worker is frozen while the model worker runs every request, and the batch's
    window passes before its finalize runs: the batch completes, it does not expire."""
    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    service.signal("model", signal.SIGSTOP)
    frozen = {"model"}
    try:
        batch_id = service.submit()
        service.wait(batch_id, 60, until=lambda b: b.status == "in_progress")
        service.signal("control", signal.SIGSTOP)
        frozen.add("control")
        service.signal("model", signal.SIGCONT)
        frozen.discard("model")
        service.wait(batch_id, 60, until=lambda b: b.status == "finalizing")
        with session_scope() as session:
            session.execute(
                update(Batch)
                .where(Batch.id == batch_id)
                .values(expires_at=now() - timedelta(seconds=1))
            )
        service.signal("control", signal.SIGCONT)
        frozen.discard("control")
        batch = service.wait(batch_id, 60)
    finally:
        for name in frozen:
            service.signal(name, signal.SIGCONT)
    assert batch.status == "completed", (batch.status, batch.errors)
    assert batch.expired_at is None and batch.error_file_id is None
    assert _ids(batch.output_file_id) == [f"r{i}" for i in range(4)]
