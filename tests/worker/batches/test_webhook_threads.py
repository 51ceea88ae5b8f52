"""Webhook deliveries have their own queue, which every worker that consumes the control queue
also consumes, and their attempts run on the process's own webhook threads: a delivery task
only hands its attempt over (or finds every thread busy) and returns."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from core.broker.queue import CONTROL_QUEUE, WEBHOOK_QUEUE, model_queue
from worker.batches import webhooks
from worker.infra.celery import app, consume_webhooks


def _worker(queues: list[str] | None) -> SimpleNamespace:
    table = app.amqp.Queues(dict(app.amqp.queues), create_missing=True)
    if queues is not None:
        table.select(queues)  # as -Q does
    return SimpleNamespace(app=SimpleNamespace(amqp=SimpleNamespace(queues=table)))


def consumed(worker: SimpleNamespace) -> set[str]:
    return set(worker.app.amqp.queues.consume_from)


def test_a_worker_of_the_control_queue_consumes_the_webhook_queue_too() -> None:
    control = _worker([CONTROL_QUEUE])
    assert consume_webhooks(control)
    assert consumed(control) == {CONTROL_QUEUE, WEBHOOK_QUEUE}
    both = _worker([CONTROL_QUEUE, model_queue("m")])  # batchd up's one worker
    assert consume_webhooks(both) and WEBHOOK_QUEUE in consumed(both)
    shards = _worker([model_queue("m")])
    assert not consume_webhooks(shards) and consumed(shards) == {model_queue("m")}


def test_deliveries_are_routed_to_the_webhook_queue() -> None:
    from core.broker.queue import TASK_DELIVER_WEBHOOK, TASK_VALIDATE

    route = app.amqp.router.route({}, TASK_DELIVER_WEBHOOK)
    assert route["queue"].name == WEBHOOK_QUEUE
    assert app.amqp.router.route({}, TASK_VALIDATE)["queue"].name == CONTROL_QUEUE


def test_attempts_run_on_their_own_threads_and_never_wait_for_one(monkeypatch) -> None:
    import time

    release = threading.Event()
    running: list[tuple[str, str]] = []

    def slow_receiver(delivery_id: str) -> None:
        running.append((delivery_id, threading.current_thread().name))
        release.wait(10)

    monkeypatch.setattr(webhooks, "deliver", slow_receiver)
    threads = webhooks.DeliveryThreads(2)
    assert threads.offer("evt_1", "t-1") and threads.offer("evt_2", "t-2")
    assert not threads.offer("evt_3", "t-3")  # both busy: refused at once, nothing waits
    release.set()
    deadline = time.monotonic() + 10
    while not threads.offer("evt_3", "t-3"):  # a thread is free again once its attempt ended
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads._executor.shutdown(wait=True)
    assert sorted(d for d, _ in running) == ["evt_1", "evt_2", "evt_3"]
    assert all(name.startswith("batchd-webhook") for _, name in running)


def test_one_tenant_holds_at_most_half_of_the_threads(monkeypatch) -> None:
    import time

    release = threading.Event()
    monkeypatch.setattr(webhooks, "deliver", lambda delivery_id: release.wait(10))
    threads = webhooks.DeliveryThreads(4)
    # A tenant whose receivers all trickle: two attempts run, the third waits its turn ...
    assert threads.offer("evt_a1", "slow") and threads.offer("evt_a2", "slow")
    assert not threads.offer("evt_a3", "slow")
    # ... while other tenants' events still find threads.
    assert threads.offer("evt_b1", "t-b") and threads.offer("evt_c1", "t-c")
    assert not threads.offer("evt_d1", "t-d")  # all four busy
    release.set()
    deadline = time.monotonic() + 10
    while not threads.offer("evt_a3", "slow"):  # its attempts ended: its part is free again
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads._executor.shutdown(wait=True)
    assert threads._held == {} and threads._busy == 0
    assert webhooks.DeliveryThreads(1).per_tenant == 1  # one thread: still one per tenant
