"""Tenant-controlled slowness never holds shared capacity: webhook receivers that trickle their
answers a byte a second hold a real control worker's webhook threads, never its control pool,
so a batch's validate and finalize (through a cancel) go on beside them; and the webhook sweep
never sends an attempt again while it runs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.launch import QUIET, control_worker_command
from testkit.service.stack import Procs, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

SLOW_RECEIVERS = 4  # more than the control pool's 2 threads
ATTEMPT_TIMEOUT_S = 90  # each trickling attempt outlives the whole test


class Trickler:
    """An HTTP receiver on loopback that reads a request, then answers one byte a second,
    forever; it records the ``webhook-id`` of every connection and how many are open."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.open = 0
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self.lock:
            self.open += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.decode("latin-1").split("\r\n"):
                name, _, value = line.partition(":")
                if name.strip().lower() == "webhook-id":
                    with self.lock:
                        self.ids.append(value.strip())
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100_000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            with self.lock:
                self.open -= 1
            writer.close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    receiver = Trickler()
    yield receiver
    receiver.close()


def _status(batch_id: str) -> str:
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        return session.get(Batch, batch_id).status


def _wait(what: str, done, timeout: float, procs: Procs) -> float:
    started = time.monotonic()
    while not done():
        procs.check_alive()
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what} not within {timeout:g}s:{procs.logs()}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_trickling_receivers_do_not_delay_validate_or_finalize(
    worker_env: dict[str, str], pg_url: str, redis_url: str, tmp_path: Path, trickler: Trickler
) -> None:
    from sqlalchemy import update

    from core.broker.queue import TASK_CANCEL, TASK_VALIDATE, enqueue
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from core.llms.demo import build
    from testkit.builders.worker import chat_line, make_batch
    from worker.batches import webhooks
    from worker.events import notify

    build("llama-tiny")  # the control worker counts tokens with its tokenizer
    deliveries = []
    # Batches that ended, each with a slow receiver; each of its own tenant, as one tenant's
    # attempts may hold only half of the webhook threads (test_webhook_threads.py).
    for n in range(SLOW_RECEIVERS):
        ended = make_batch([chat_line("a", "hello", 4)])
        with session_scope() as session:
            session.execute(
                update(Batch)
                .where(Batch.id == ended)
                .values(webhook_url=trickler.url(f"/slow/{n}"), tenant=f"slow-{n}")
            )
            assert transition(session, ended, "validating", "failed")
        deliveries.append(notify(ended, "failed"))
    env = stack_env(
        pg_url,
        redis_url,
        tmp_path,
        BATCHD_STORAGE_URL=worker_env["BATCHD_STORAGE_URL"],
        BATCHD_WEBHOOK_TIMEOUT_S=str(ATTEMPT_TIMEOUT_S),
        BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.1",
        BATCHD_WEBHOOK_CONCURRENCY=str(SLOW_RECEIVERS),
    )
    procs = Procs(tmp_path)
    control = control_worker_command("isolation@test", extra=QUIET)
    try:
        procs.start("control", control, env)
        procs.wait_log("control", "ready.", 120)
        # At least as many slow attempts as the control pool has threads are under way.
        _wait("the slow attempts", lambda: trickler.open >= 2, 30, procs)

        batch_id = make_batch([chat_line(f"r{i}", f"hello {i}", 4) for i in range(3)])
        enqueue(TASK_VALIDATE, batch_id)
        took = _wait("the validate", lambda: _status(batch_id) != "validating", 30, procs)
        assert _status(batch_id) == "in_progress" and took < 30
        with session_scope() as session:
            assert transition(session, batch_id, "in_progress", "cancelling")
        enqueue(TASK_CANCEL, batch_id)
        _wait("the finalize", lambda: _status(batch_id) == "cancelled", 30, procs)

        # Every slow receiver holds a webhook thread of its own, beside the control pool.
        _wait("every slow attempt", lambda: trickler.open == SLOW_RECEIVERS, 30, procs)
        # While the attempts run (each far from its timeout), the sweep sends none again.
        for _ in range(3):
            webhooks.sweep_unsent(older_than_s=0)
            time.sleep(1)
        assert sorted(trickler.ids) == sorted(deliveries)  # one connection each, no duplicate
        assert trickler.open == SLOW_RECEIVERS
    finally:
        trickler.close()  # the attempts end with their receivers, so the worker stops at once
        procs.stop_all(grace_s=20)
