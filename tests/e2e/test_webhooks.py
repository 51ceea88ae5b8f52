"""Batch webhooks end to end: a real HTTP receiver on 127.0.0.1 (allowed by
BATCHD_WEBHOOK_ALLOWED_HOSTS, as loopback is refused by default) gets a signed event when a
batch completes or fails validation; a receiver that errors is retried with backoff until it
answers 2xx (or the attempts run out), and every attempt is recorded in webhook_deliveries;
a redirect is not followed. Every receiver here is on loopback.

The event is recorded with the batch's terminal transition (an outbox): a control worker that
dies right after that commit, before it enqueued the delivery, loses nothing; the webhook
sweep sends it, once, under the event id recorded with the transition."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from testkit.builders.lines import chat_line, jsonl

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = {"completed", "failed", "expired", "cancelled"}
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def _fast_retries() -> Iterator[None]:
    """Short backoff and few attempts for the stack this module starts (read by the workers;
    set before the module's ``stack`` fixture starts them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHD_WEBHOOK_BACKOFF_S", "0.3")
        mp.setenv("BATCHD_WEBHOOK_BACKOFF_MAX_S", "1")
        mp.setenv("BATCHD_WEBHOOK_MAX_ATTEMPTS", "4")
        mp.setenv("BATCHD_WEBHOOK_TIMEOUT_S", "5")
        # The receiver is on loopback, which webhooks may reach only when the operator allows
        # it; this address alone, so other loopback addresses stay refused.
        mp.setenv("BATCHD_WEBHOOK_ALLOWED_HOSTS", "127.0.0.1")
        yield


class Receiver:
    """Records every POST; answers each path with its scripted status codes, then 200."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body}
                    )
                    codes = receiver.script.get(self.path, [])
                    code = codes.pop(0) if codes else 200
                self.send_response(code)
                if 300 <= code < 400:  # a redirect to another path of this receiver
                    self.send_header("location", "/redirected")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def received(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["path"] == path]

    def wait(self, path: str, count: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.received(path)
            if len(got) >= count:
                return got
            time.sleep(0.1)
        raise AssertionError(f"{path}: {len(self.received(path))} deliveries, wanted {count}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def verify_signature(secret: str, request: dict[str, Any]) -> bool:
    """Standard Webhooks verification, written out as a receiver would."""
    headers = {k.lower(): v for k, v in request["headers"].items()}
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + request["body"]
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    versions = [s.split(",", 1) for s in headers["webhook-signature"].split()]
    return any(v == "v1" and hmac.compare_digest(sig, expected) for v, sig in versions)


def _submit(stack, lines: list[Any], webhook_url: str):
    data = jsonl(lines)
    f = stack.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return stack.client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"webhook_url": webhook_url},
    )


def _wait_terminal(stack, batch_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        batch = stack.client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, f"{batch_id} is still {batch.status}"
        time.sleep(0.2)


def _deliveries(stack, batch_id: str) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine, text

    engine = create_engine(stack.env["BATCHD_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT * FROM webhook_deliveries WHERE batch_id = :b ORDER BY created_at"),
                {"b": batch_id},
            )
            return [dict(r._mapping) for r in rows]
    finally:
        engine.dispose()


def _wait_delivery(stack, batch_id: str, status: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        rows = _deliveries(stack, batch_id)
        if rows and rows[0]["status"] == status:
            return rows[0]
        assert time.monotonic() < deadline, f"deliveries of {batch_id}: {rows}"
        time.sleep(0.2)


def _check_event(request: dict[str, Any], secret: str, batch_id: str, event_type: str) -> dict:
    assert verify_signature(secret, request), request["headers"]
    assert not verify_signature("whsec_" + base64.b64encode(os.urandom(32)).decode(), request)
    headers = {k.lower(): v for k, v in request["headers"].items()}
    event = json.loads(request["body"])
    assert event["object"] == "event"
    assert event["type"] == event_type
    assert event["data"] == {"id": batch_id}
    assert event["id"] == headers["webhook-id"] and event["id"].startswith("evt_")
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
    assert abs(event["created_at"] - time.time()) < 120
    assert headers["content-type"] == "application/json"
    return event


def test_completed_batch_sends_a_signed_event(stack, receiver):
    created = _submit(
        stack, [chat_line(f"r{i}", f"hello {i}", 6) for i in range(3)], receiver.url("/ok")
    )
    secret = created.model_extra["webhook_secret"]
    assert secret.startswith("whsec_")
    batch = _wait_terminal(stack, created.id)
    assert batch.status == "completed"
    (request,) = receiver.wait("/ok", 1, 30)
    event = _check_event(request, secret, created.id, "batch.completed")
    row = _wait_delivery(stack, created.id, "delivered")
    assert row["id"] == event["id"] and row["event_type"] == "batch.completed"
    assert (row["attempts"], row["last_status_code"], row["last_error"]) == (1, 200, None)
    assert row["url"] == receiver.url("/ok") and row["delivered_at"] is not None


def test_failed_validation_sends_batch_failed(stack, receiver):
    created = _submit(stack, ["{not json", chat_line("a", "hi", 6)], receiver.url("/failed"))
    secret = created.model_extra["webhook_secret"]
    batch = _wait_terminal(stack, created.id, 60)
    assert batch.status == "failed"
    (request,) = receiver.wait("/failed", 1, 30)
    _check_event(request, secret, created.id, "batch.failed")
    assert _wait_delivery(stack, created.id, "delivered")["attempts"] == 1


def test_receiver_errors_are_retried_with_the_same_event(stack, receiver):
    receiver.script["/flaky"] = [500, 500, 200]
    created = _submit(stack, [chat_line("x", "hello", 6)], receiver.url("/flaky"))
    secret = created.model_extra["webhook_secret"]
    assert _wait_terminal(stack, created.id).status == "completed"
    requests = receiver.wait("/flaky", 3, 30)
    row = _wait_delivery(stack, created.id, "delivered")
    assert (row["attempts"], row["last_status_code"], row["last_error"]) == (3, 200, None)
    assert len(receiver.received("/flaky")) == 3  # nothing after the 2xx
    assert len({r["body"] for r in requests}) == 1  # the same event every time
    assert len({r["headers"]["webhook-id"] for r in requests}) == 1
    for request in requests:
        _check_event(request, secret, created.id, "batch.completed")


def test_delivery_fails_for_good_after_the_last_attempt(stack, receiver):
    receiver.script["/down"] = [503] * 10
    created = _submit(stack, [chat_line("x", "hello", 6)], receiver.url("/down"))
    assert _wait_terminal(stack, created.id).status == "completed"
    row = _wait_delivery(stack, created.id, "failed")
    assert (row["attempts"], row["last_status_code"]) == (4, 503)
    assert "HTTP 503" in row["last_error"] and row["delivered_at"] is None
    time.sleep(1.5)  # longer than the capped backoff: no fifth attempt
    assert len(receiver.received("/down")) == 4


def test_redirects_are_not_followed(stack, receiver):
    receiver.script["/moved"] = [307] * 10
    created = _submit(stack, [chat_line("x", "hello", 6)], receiver.url("/moved"))
    assert _wait_terminal(stack, created.id).status == "completed"
    row = _wait_delivery(stack, created.id, "failed")
    assert (row["attempts"], row["last_status_code"]) == (4, 307)
    assert len(receiver.received("/moved")) == 4
    assert receiver.received("/redirected") == []


def test_loopback_outside_the_allow_list_is_refused_at_create(stack, receiver):
    import openai

    before = len(receiver.requests)
    for host in ("127.0.0.2", "[::1]", "2130706434", "0x7f.2"):  # not 127.0.0.1, the allowed
        url = f"http://{host}:{receiver.server.server_address[1]}/refused"
        with pytest.raises(openai.BadRequestError) as caught:
            _submit(stack, [chat_line("x", "hello", 6)], url)
        assert caught.value.body["param"] == "webhook_url", host
        assert "loopback" in caught.value.body["message"], host
    assert len(receiver.requests) == before


def _outbox(batch_id: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from core.database.sessions import session_scope
    from core.database.tables import WebhookDelivery

    with session_scope() as session:
        rows = session.scalars(select(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id))
        return [
            {"id": r.id, "event_type": r.event_type, "status": r.status, "attempts": r.attempts}
            for r in rows
        ]


def test_a_worker_killed_between_the_terminal_commit_and_the_enqueue_loses_no_event(
    procs, private_broker, pg_url, receiver, tmp_path, monkeypatch
):
    """A control worker (with the test-only ``control_faults``) exits right after committing a
    batch's terminal status, before it enqueues the webhook delivery: once after a validate
    that failed the batch (worker/batches/tasks.py), once after the finalize of a cancel
    (worker/batches/finalize.py). The event row committed with the status; after a restart the
    webhook sweep sends each one, and the receiver gets it exactly once, under that id."""
    from sqlalchemy import update

    from core.broker.queue import TASK_CANCEL, TASK_VALIDATE, enqueue
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from core.settings import get_settings
    from testkit.builders.worker import batch_row, make_batch
    from testkit.service.stack import celery_command, stack_env

    faults = tmp_path / "faults"
    faults.mkdir()
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_TEST_FAULT_DIR=str(faults),
        BATCHD_WEBHOOK_UNSENT_AFTER_S="1",
        BATCHD_WEBHOOK_SWEEP_INTERVAL_S="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    # This process creates the batches on the same database, storage and broker.
    for key in ("BATCHD_DATABASE_URL", "BATCHD_STORAGE_URL", "BATCHD_BROKER_URL"):
        monkeypatch.setenv(key, env[key])
    get_settings.cache_clear()
    control = [*celery_command("control", "control", tmp_path), "-I", "control_faults"]

    def start_control() -> None:
        starts = procs.log("control").count("ready.")
        procs.start("control", control, env)
        procs.wait_log("control", "ready.", 120, count=starts + 1)

    def died_after_commit(batch_id: str, status: str) -> str:
        """The control worker exited at the fault; the batch ended with its event recorded,
        not yet attempted. Returns the event id."""
        assert procs.procs["control"].wait(60) == 70, procs.logs()
        assert batch_row(batch_id).status == status
        (row,) = _outbox(batch_id)
        assert (row["event_type"], row["status"], row["attempts"]) == (
            f"batch.{status}",
            "pending",
            0,
        )
        return row["id"]

    def submit(lines: bytes, path: str) -> str:
        batch_id = make_batch(lines)
        with session_scope() as session:
            session.execute(
                update(Batch)
                .where(Batch.id == batch_id)
                .values(webhook_url=receiver.url(path), webhook_secret="whsec_" + "A" * 44)
            )
        (faults / batch_id).write_text("notify:exit")
        enqueue(TASK_VALIDATE, batch_id, broker_url=private_broker)
        return batch_id

    try:
        procs.start("beat", celery_command("beat", "beat", tmp_path), env)
        start_control()
        # 1. A validate fails the batch, and the worker dies before enqueueing the event.
        failed = submit(b"{not json\n", "/outbox-failed")
        failed_event = died_after_commit(failed, "failed")
        start_control()
        # 2. A batch is cancelled while in progress (no model worker runs it); the finalize
        # of the cancel commits "cancelled", and the worker dies again.
        cancelled = submit(jsonl([chat_line("a", "hello", 4)]), "/outbox-cancelled")
        wait_for_status = time.monotonic() + 60
        while batch_row(cancelled).status != "in_progress":
            assert time.monotonic() < wait_for_status, procs.logs()
            time.sleep(0.2)
        with session_scope() as session:
            assert transition(session, cancelled, "in_progress", "cancelling")
        enqueue(TASK_CANCEL, cancelled, broker_url=private_broker)
        cancelled_event = died_after_commit(cancelled, "cancelled")
        start_control()
        # The sweep delivers both, each under the id recorded with its transition.
        for batch_id, path, event_id, status in (
            (failed, "/outbox-failed", failed_event, "failed"),
            (cancelled, "/outbox-cancelled", cancelled_event, "cancelled"),
        ):
            (request,) = receiver.wait(path, 1, 30)
            event = json.loads(request["body"])
            headers = {k.lower(): v for k, v in request["headers"].items()}
            assert event["id"] == event_id == headers["webhook-id"]
            assert (event["type"], event["data"]) == (f"batch.{status}", {"id": batch_id})
            assert verify_signature("whsec_" + "A" * 44, request)
        time.sleep(3)  # several sweeps later: still one delivery each, one row each
        for batch_id, path in ((failed, "/outbox-failed"), (cancelled, "/outbox-cancelled")):
            assert len(receiver.received(path)) == 1
            (row,) = _outbox(batch_id)
            assert (row["status"], row["attempts"]) == ("delivered", 1)
        assert procs.log("control").count("injected fault: the process exits at notify") == 2
    finally:
        get_settings.cache_clear()
