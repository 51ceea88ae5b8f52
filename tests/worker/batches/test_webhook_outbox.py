"""The webhook outbox on real Postgres and Redis: a batch's terminal transition records its
event in the same transaction (and a rolled-back one records nothing); the actor's enqueue
after the commit is best effort, and when it fails the row stays, pending, for the webhook
sweep to send under the same event id."""

from __future__ import annotations

import base64
import json

import pytest

pytestmark = pytest.mark.services

URL = "https://hooks.example.com/batchd"


def batch_with_webhook(url: str | None = URL) -> str:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from testkit.builders.worker import chat_line, make_batch

    batch_id = make_batch([chat_line("a", "hello", 4)])
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(webhook_url=url))
    return batch_id


def outbox(batch_id: str) -> list[dict]:
    from sqlalchemy import select

    from core.database.sessions import session_scope
    from core.database.tables import WebhookDelivery

    with session_scope() as session:
        rows = session.scalars(select(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id))
        return [
            {
                "id": r.id,
                "event_type": r.event_type,
                "url": r.url,
                "status": r.status,
                "attempts": r.attempts,
            }
            for r in rows
        ]


def queued_deliveries(redis_url: str) -> list[str]:
    """Delivery ids of the webhook tasks waiting on the webhook queue."""
    import redis

    from core.broker.queue import TASK_DELIVER_WEBHOOK, WEBHOOK_QUEUE

    ids = []
    for raw in redis.Redis.from_url(redis_url).lrange(WEBHOOK_QUEUE, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == TASK_DELIVER_WEBHOOK:
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            ids.append(args[0])
    return ids


def end(batch_id: str, target: str = "failed", *, commit: bool = True) -> bool:
    from core.database.lifecycle import transition
    from core.database.sessions import new_session

    session = new_session()
    try:
        won = transition(session, batch_id, "validating", target)
        if commit:
            session.commit()
        else:
            session.rollback()
        return won
    finally:
        session.close()


def test_the_terminal_transition_records_the_event_in_its_transaction(worker_env):
    batch_id = batch_with_webhook()
    assert end(batch_id, "failed", commit=False)
    assert outbox(batch_id) == []  # rolled back with the transition
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)
    assert row["id"].startswith("evt_")
    assert row | {"id": None} == {
        "id": None,
        "event_type": "batch.failed",
        "url": URL,
        "status": "pending",
        "attempts": 0,
    }
    assert not end(batch_id, "failed")  # a loser records nothing
    assert len(outbox(batch_id)) == 1


def test_no_event_without_a_webhook_or_before_a_terminal_status(worker_env):
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope

    quiet = batch_with_webhook(None)
    assert end(quiet, "failed")
    assert outbox(quiet) == []
    running = batch_with_webhook()
    with session_scope() as session:
        assert transition(session, running, "validating", "cancelling")
    assert outbox(running) == []


def test_a_failing_enqueue_leaves_the_row_for_the_sweep(worker_env, redis_url, monkeypatch):
    from worker import events
    from worker.batches import webhooks

    batch_id = batch_with_webhook()
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)

    def broker_down(*args, **kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr(events, "send", broker_down)
    assert events.notify(batch_id, "failed") == row["id"]  # never raises
    assert outbox(batch_id) == [row]  # still pending, never attempted
    monkeypatch.undo()
    assert webhooks.sweep_unsent(older_than_s=3600) == 0  # too recent for the sweep yet
    assert webhooks.sweep_unsent(older_than_s=0) >= 1
    assert row["id"] in queued_deliveries(redis_url)


def test_notify_enqueues_the_recorded_event_once(worker_env, redis_url):
    from worker.events import notify

    batch_id = batch_with_webhook()
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)
    assert notify(batch_id, "failed") == row["id"]
    assert queued_deliveries(redis_url).count(row["id"]) == 1
    assert notify(batch_id, "completed") is None  # not the status it ended in
    assert len(outbox(batch_id)) == 1


def test_an_attempt_or_retry_lost_on_the_way_is_sent_again_by_the_sweep(
    worker_env, redis_url, monkeypatch
):
    """An attempt whose worker dies mid-POST, and a retry whose task is lost (a SIGKILL, a
    broker blip), leave the row pending with attempts made: the sweep sends it again once its
    next attempt is overdue, and a duplicate task ahead of that time does nothing."""
    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import WebhookDelivery
    from worker.batches import webhooks

    batch_id = batch_with_webhook()
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)

    class Killed(BaseException):
        """The worker dying in the middle of the POST."""

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(webhooks, "post_pinned", killed)
    with pytest.raises(Killed):
        webhooks.attempt(row["id"])
    assert outbox(batch_id)[0]["attempts"] == 1  # claimed, then lost
    assert row["id"] not in queued_deliveries(redis_url)
    webhooks.sweep_unsent(older_than_s=0)  # the attempt may still be running
    assert row["id"] not in queued_deliveries(redis_url)
    webhooks.sweep_unsent(older_than_s=-60)  # ... until it is overdue (its timeout is 10 s)
    assert queued_deliveries(redis_url).count(row["id"]) == 1

    def time_passes() -> None:  # the row's next attempt has come
        with session_scope() as session:
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == row["id"])
                .values(next_attempt_at=now())
            )

    time_passes()
    monkeypatch.setattr(webhooks, "post_pinned", lambda *a, **k: (500, "try later"))
    wait = webhooks.attempt(row["id"])
    assert wait is not None and wait > 0  # a retry is scheduled...
    assert outbox(batch_id)[0]["attempts"] == 2
    assert webhooks.attempt(row["id"]) is None  # ... and a duplicate task before it is a no-op
    assert outbox(batch_id)[0]["attempts"] == 2
    assert webhooks.sweep_unsent(older_than_s=-(wait + 60)) >= 1  # the retry's task was lost
    assert queued_deliveries(redis_url).count(row["id"]) == 2

    time_passes()
    monkeypatch.setattr(webhooks, "post_pinned", lambda *a, **k: (204, ""))
    assert webhooks.attempt(row["id"]) is None
    assert outbox(batch_id)[0] | {"attempts": 0} == row | {"status": "delivered"}


def test_the_sweep_sends_a_row_once_until_that_send_is_overdue(worker_env, redis_url):
    """The sweep stamps what it sends: the next sweeps (every webhook_sweep_interval_s) leave
    a task on its way alone, instead of adding a copy each time while it waits for a webhook
    thread, until that send is overdue in turn."""
    from datetime import timedelta

    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import WebhookDelivery
    from worker.batches import webhooks

    batch_id = batch_with_webhook()
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)
    with session_scope() as session:  # recorded an hour ago, never sent
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == row["id"])
            .values(next_attempt_at=now() - timedelta(hours=1))
        )
    assert webhooks.sweep_unsent(older_than_s=60) >= 1
    assert queued_deliveries(redis_url).count(row["id"]) == 1
    webhooks.sweep_unsent(older_than_s=60)
    webhooks.sweep_unsent(older_than_s=60)
    assert queued_deliveries(redis_url).count(row["id"]) == 1
    webhooks.sweep_unsent(older_than_s=-1)  # as a sweep 61 s on would: that task was lost
    assert queued_deliveries(redis_url).count(row["id"]) == 2


def test_the_sweep_never_sends_a_live_attempt_again(worker_env, redis_url, monkeypatch):
    """An attempt whose host resolves slowly (the name server belongs to whoever set the URL)
    is cut off at its timeout like a slow receiver, so it is never still running when its row
    says it is overdue, and the sweeps running beside it never send the event again."""
    import threading
    import time

    from core.settings import get_settings
    from worker.batches import webhooks

    monkeypatch.setenv("BATCHD_WEBHOOK_TIMEOUT_S", "1")
    monkeypatch.setenv("BATCHD_WEBHOOK_ALLOWED_HOSTS", "127.0.0.1")
    get_settings.cache_clear()
    batch_id = batch_with_webhook("http://hooks.invalid/slow-dns")
    assert end(batch_id, "failed")
    (row,) = outbox(batch_id)

    def slow_name_server(host: str, port: int) -> list[str]:
        time.sleep(4)
        return ["127.0.0.1"]

    started = time.monotonic()
    attempt = threading.Thread(
        target=webhooks.attempt, args=(row["id"],), kwargs={"resolver": slow_name_server}
    )
    attempt.start()
    while outbox(batch_id)[0]["attempts"] == 0 and time.monotonic() - started < 5:
        time.sleep(0.02)  # until the attempt has claimed the row
    sweeps = 0
    while attempt.is_alive() and time.monotonic() - started < 10:
        webhooks.sweep_unsent(older_than_s=0)
        sweeps += 1
        time.sleep(0.1)
    attempt.join(10)
    took = time.monotonic() - started
    assert sweeps > 0 and row["id"] not in queued_deliveries(redis_url)
    assert took < 1 + webhooks.ATTEMPT_GRACE_S  # bounded by its timeout, not the name server
    (after,) = outbox(batch_id)
    assert after["attempts"] == 1 and after["status"] == "pending"  # a retry is scheduled
