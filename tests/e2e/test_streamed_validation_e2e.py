"""Validation streamed into execution, on the real service: the API, control and model workers
and beat as subprocesses on Postgres, a private Redis and a local storage directory, with
shards of 4 requests. The control worker loads ``validation_faults``, which pauses a batch's
validation after a given shard, so each test acts while the batch is ``in_progress``, its
first shard's results committed and the rest of its input not yet validated:

* a whole-file rule broken late (more than ``max_requests_per_batch`` lines) fails the batch
  with no file and nothing shown by ``GET /v1/batches/{id}/results``, before or after;
* a cancel during validation ends with one output or error line per input line;
* a SIGKILL of the control worker during validation: the reclaim sweep sends the validation
  again to a new worker, which resumes after the last shard; every line ends in exactly one
  output line.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL
from testkit.builders.worker import batch_row, chat_line, read_file_lines
from testkit.service.stack import (
    API_KEY,
    Procs,
    api_command,
    celery_command,
    private_redis,
    stack_env,
)

pytestmark = [pytest.mark.services, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
SHARD = 4
MAX_REQUESTS = 20
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class Service:
    procs: Procs
    root: Path
    faults: Path
    env: dict[str, str]
    base_url: str
    client: Any  # openai.OpenAI
    control: str = "control"

    def control_command(self, name: str) -> list[str]:
        return [*celery_command("control", name, self.root), "-I", "validation_faults"]

    def paused_batch(self, n: int, after_shard: int, tail: bytes = b"") -> tuple[str, list[str]]:
        """Upload ``n`` requests (then ``tail``), create their batch with its validation to
        pause after ``after_shard``; wait until it is paused and the first shard's results are
        committed. The batch id and its custom_ids."""
        ids = [f"r{i}" for i in range(n)]
        data = b"".join(json.dumps(chat_line(c, f"say {c}", 3)).encode() + b"\n" for c in ids)
        data += tail
        upload = self.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        (self.faults / upload.id).write_text(f"pause:{after_shard}")
        batch = self.client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        self.procs.wait_log(
            self.control, f"validation of {batch.id} paused after shard {after_shard}", 60
        )
        wait_for(lambda: batch_row(batch.id).results_logged >= SHARD, 60, "results", self.logs)
        return batch.id, ids

    def go(self, batch_id: str) -> None:
        key = self.input_file(batch_id)
        (self.faults / (key + ".go")).write_text("")

    def input_file(self, batch_id: str) -> str:
        return batch_row(batch_id).input_file_id

    def results(self, batch_id: str) -> list[dict]:
        import httpx

        reply = httpx.get(
            f"{self.base_url}/batches/{batch_id}/results",
            params={"limit": 1000},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=10,
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["data"]

    def wait(self, batch_id: str, timeout: float) -> Any:
        found: list[Any] = []

        def done() -> bool:
            found[:] = [batch_row(batch_id)]
            return found[0].status in TERMINAL

        wait_for(done, timeout, f"batch {batch_id}", self.logs)
        return found[0]

    def logs(self) -> str:
        return self.procs.logs()


@pytest.fixture(scope="module")
def service(
    pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    import httpx
    from openai import OpenAI

    from core.llms.demo import build
    from core.settings import get_settings

    build("llama-tiny")  # once, before two processes race to build it
    root = tmp_path_factory.mktemp("streamed-validation")
    faults = root / "faults"
    faults.mkdir()
    port = free_port()
    with private_redis(redis_url, root) as broker, pytest.MonkeyPatch.context() as mp:
        env = stack_env(
            pg_url,
            broker,
            root,
            BATCHD_SHARD_MAX_REQUESTS=str(SHARD),
            BATCHD_MAX_REQUESTS_PER_BATCH=str(MAX_REQUESTS),
            BATCHD_CHECKPOINT_EVERY=str(SHARD),
            BATCHD_CHECKPOINT_INTERVAL_S="0.5",
            BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
            BATCHD_RECLAIM_SWEEP_INTERVAL_S="1",
            BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
            BATCHD_STUCK_BATCH_AFTER_S="3",
            BATCHD_TEST_FAULT_DIR=str(faults),
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        )
        # This process reads batches and files on the same database and storage.
        for key in ("BATCHD_DATABASE_URL", "BATCHD_STORAGE_URL", "BATCHD_BROKER_URL"):
            mp.setenv(key, env[key])
        get_settings.cache_clear()
        procs = Procs(root)
        base_url = f"http://127.0.0.1:{port}/v1"
        client = OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
        service = Service(procs, root, faults, env, base_url, client)
        try:
            procs.start("api", api_command(port), env)
            procs.start("control", service.control_command("control"), env)
            procs.start("model", celery_command("model", "model", root), env)
            procs.start("beat", celery_command("beat", "beat", root), env)
            procs.wait_log("control", "ready.", 180)
            procs.wait_log("model", f"model {MODEL} ready", 180)

            def api_up() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).is_success
                except httpx.HTTPError:
                    return False

            wait_for(api_up, 60, "the API", procs.logs)
            yield service
        finally:
            procs.stop_all()
            get_settings.cache_clear()


def test_too_many_requests_found_late_fails_the_batch_showing_nothing(service):
    batch_id, _ = service.paused_batch(MAX_REQUESTS + 4, after_shard=0)
    batch = batch_row(batch_id)
    assert batch.status == "in_progress" and not batch.validation_done
    assert service.results(batch_id) == []  # committed, not shown: validation is not done

    service.go(batch_id)
    batch = service.wait(batch_id, 60)
    assert batch.status == "failed", (batch.status, batch.errors)
    (error,) = batch.errors
    assert (error["code"], error["line"]) == ("too_many_requests", MAX_REQUESTS + 1)
    assert str(MAX_REQUESTS) in error["message"]
    assert batch.output_file_id is None and batch.error_file_id is None
    assert service.results(batch_id) == []
    public = service.client.batches.retrieve(batch_id)
    assert public.status == "failed" and public.output_file_id is None


def test_cancel_during_validation_reports_every_line(service):
    batch_id, ids = service.paused_batch(18, after_shard=1)
    service.client.batches.cancel(batch_id)
    service.go(batch_id)
    batch = service.wait(batch_id, 60)
    assert batch.status == "cancelled", (batch.status, batch.errors)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(ids)
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert len(out) >= SHARD  # the first shard ran before the cancel
    assert service.client.batches.retrieve(batch_id).request_counts.total == len(ids)
    shown = service.results(batch_id)  # a cancelled batch shows what its files hold
    assert sorted(r["custom_id"] for r in shown) == sorted(ids)


def test_control_worker_killed_during_validation_resumes_after_its_last_shard(service):
    batch_id, ids = service.paused_batch(MAX_REQUESTS, after_shard=1)
    service.procs.kill(service.control)  # SIGKILL: the validate task is never acknowledged
    (service.faults / service.input_file(batch_id)).unlink()
    service.control = "control-2"
    service.procs.start(service.control, service.control_command(service.control), service.env)

    batch = service.wait(batch_id, 120)
    assert batch.status == "completed", (batch.status, batch.errors)
    out = read_file_lines(batch.output_file_id)
    assert [r["custom_id"] for r in out] == ids  # each line once, in order
    assert batch.error_file_id is None and batch.request_total == len(ids)
    shards = service.client.batches.retrieve(batch_id)
    assert shards.request_counts.completed == len(ids)
    log = service.procs.log(service.control)
    assert f"resumes at line {2 * SHARD + 1} (shard 2)" in log
    assert sorted(r["custom_id"] for r in service.results(batch_id)) == sorted(ids)


# ---------------------------------------------------------------------------------------------
# Lines no validation has read yet, cut short by a cancel or an expiry.

DEEP = b'{"custom_id": "deep", "body": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001
LIST_ID = json.dumps({**chat_line("x", "hi", 3), "custom_id": ["x"]}).encode()


def _expire_now(batch_id: str) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(expires_at=now() - timedelta(seconds=1))
        )


def test_cancel_during_validation_with_a_line_nested_too_deeply_ends_and_retries(service):
    """A never-validated line nested too deeply to parse (and one whose custom_id is a list)
    gets its batch_cancelled line like any other: the cancel ends, and a retry of the batch
    copies the lines it can name instead of answering 500."""
    import httpx

    batch_id, ids = service.paused_batch(8, after_shard=0, tail=DEEP + b"\n" + LIST_ID + b"\n")
    service.client.batches.cancel(batch_id)
    service.go(batch_id)
    batch = service.wait(batch_id, 60)
    assert batch.status == "cancelled", (batch.status, batch.errors)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert len(out) >= SHARD
    assert sorted(r["custom_id"] or "" for r in out + err) == sorted([*ids, "", ""])
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert batch.request_total == len(ids) + 2

    files_before = len(service.client.files.list().data)
    refused = httpx.post(
        f"{service.base_url}/batches/{batch_id}/retry",
        json={"completion_window": "9999d"},  # over the server's longest window
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    assert len(service.client.files.list().data) == files_before  # checked before copying
    reply = httpx.post(
        f"{service.base_url}/batches/{batch_id}/retry",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    retry = reply.json()
    copied = read_file_lines(retry["input_file_id"])
    assert [r["custom_id"] for r in copied] == [r["custom_id"] for r in err if r["custom_id"]]
    assert service.wait(retry["id"], 60).status == "completed"


def test_expiry_during_validation_with_a_line_nested_too_deeply_keeps_the_results(service):
    batch_id, ids = service.paused_batch(8, after_shard=0, tail=DEEP + b"\n")
    _expire_now(batch_id)
    service.go(batch_id)
    batch = service.wait(batch_id, 60)
    assert batch.status == "expired", (batch.status, batch.errors)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert len(out) >= SHARD  # the first shard's results, computed before the window ended
    assert sorted(r["custom_id"] or "" for r in out + err) == sorted([*ids, ""])
    assert {r["error"]["code"] for r in err} == {"batch_expired"}


def test_cancel_of_an_amplifying_upload_writes_no_more_lines_than_the_request_limit(service):
    """2,000 two-byte junk lines after the first shard: the cancel reports as many lines as a
    batch may hold requests, and one line naming the limit for the rest."""
    batch_id, ids = service.paused_batch(8, after_shard=0, tail=b"a\n" * 2000)
    service.client.batches.cancel(batch_id)
    service.go(batch_id)
    batch = service.wait(batch_id, 60)
    assert batch.status == "cancelled", (batch.status, batch.errors)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert len(out) + len(err) == MAX_REQUESTS + 1
    *cancelled, rest = err
    assert {r["error"]["code"] for r in cancelled} == {"batch_cancelled"}
    assert rest["custom_id"] is None and rest["error"]["code"] == "batch_cancelled"
    assert "max_requests_per_batch" in rest["error"]["message"], rest
    assert batch.request_total == MAX_REQUESTS + 1  # the line that stands for the rest too
    assert len(service.results(batch_id)) == MAX_REQUESTS + 1  # the files, as the log shows
