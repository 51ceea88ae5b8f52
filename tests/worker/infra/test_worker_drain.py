"""A worker's drain (SIGTERM), shard by shard, on real Postgres, Redis, local storage and an
in-process engine host held by a gate (testkit.engine_gate): a draining shard feeds no
more, lets its requests in flight finish until the drain is due, aborts the rest, and is
handed back (pending, its checkpoints kept, its task sent again, its attempt fenced off); the
next attempt resumes it at once, a hand-back costing no attempt. The drain's own bound."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.builders.worker import (
    MODEL,
    batch_row,
    chat_line,
    read_file_lines,
    shard_rows,
    validated_batch,
)

pytestmark = pytest.mark.services

GATE = "drain"


@pytest.fixture
def gated_host() -> Iterator[tuple[Any, threading.Event]]:
    """An engine host of two sequences whose engine holds while a line marked ``GATE-drain``
    is in it and the returned event is not set; at most two requests wait in the host."""
    from core.llms.demo import build
    from engine import Engine, EngineHost
    from testkit import engine_gate

    opened = threading.Event()
    engine = Engine(str(build("llama-tiny")), max_num_seqs=2)
    engine_gate.install(engine, lambda name: not opened.is_set())
    host = EngineHost(engine, max_pending=2, group_window=2).start()
    try:
        yield host, opened
    finally:
        opened.set()
        host.shutdown(wait=True, abort_pending=True, timeout=30)


@pytest.fixture
def drain_env(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Checkpoints every 2 results or 0.2 s; one attempt allowed (hand-backs must not count)."""
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_CHECKPOINT_EVERY", "2")
    monkeypatch.setenv("BATCHD_CHECKPOINT_INTERVAL_S", "0.2")
    monkeypatch.setenv("BATCHD_MAX_SHARD_ATTEMPTS", "1")
    get_settings.cache_clear()
    return worker_env


def _wait(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _sent_shards(redis_url: str) -> list[str]:
    import redis

    from core.broker.queue import model_queue

    client = redis.Redis.from_url(redis_url)
    return [json.loads(m)["headers"]["argsrepr"] for m in client.lrange(model_queue(MODEL), 0, -1)]


def _lines(gate_at: int, n: int) -> tuple[list[str], list[dict[str, Any]]]:
    """``n`` lines, the one at ``gate_at`` marked to hold the engine."""
    from testkit.engine_gate import marker

    ids = [f"d{i:02d}" for i in range(n)]
    texts = [f"story {i}" + (f" {marker(GATE)}" if i == gate_at else "") for i in range(n)]
    return ids, [chat_line(c, t, 6, ignore_eos=True) for c, t in zip(ids, texts, strict=True)]


def _run_in_thread(shard_id: int, host: Any, drain: Any) -> tuple[threading.Thread, list[Any]]:
    from worker.shards.task import run_shard

    outcome: list[Any] = []
    thread = threading.Thread(
        target=lambda: outcome.append(run_shard(shard_id, host=host, drain=drain))
    )
    thread.start()
    return thread, outcome


def _resume_and_finish(batch_id: str, ids: list[str], host: Any, opened: threading.Event) -> Any:
    """Run the handed-back shard again (the gate open), finalize, check one line per request."""
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    (before,) = shard_rows(batch_id)
    opened.set()
    outcome = run_shard(before.id, host=host)
    # Resumed from its checkpoints, not failed although max_shard_attempts is 1.
    assert (outcome.end, outcome.ran) == (ShardEnd.DONE, len(ids) - before.done_requests)
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out, err = read_file_lines(batch.output_file_id), read_file_lines(batch.error_file_id)
    assert not err, err[:2]
    assert [r["custom_id"] for r in out] == ids  # each exactly once, in input order
    (after,) = shard_rows(batch_id)
    assert (after.status, after.attempts, after.handbacks) == ("done", 2, 1)
    return outcome


def test_drain_aborts_what_is_in_flight_when_due_and_hands_the_shard_back(
    drain_env, gated_host, redis_url
):
    from core.database.lifecycle import ShardStatus
    from worker.infra.drain import Drain
    from worker.shards.state import Pending, ShardLost, commit_chunk
    from worker.shards.task import ShardEnd

    host, opened = gated_host
    ids, lines = _lines(gate_at=6, n=12)
    batch_id = validated_batch(lines)
    (shard,) = shard_rows(batch_id)
    drain = Drain()
    thread, outcome = _run_in_thread(shard.id, host, drain)
    # The lines before the marked one finish and are committed; then the engine holds.
    _wait(lambda: shard_rows(batch_id)[0].done_requests >= 5, "the first results")
    began = time.monotonic()
    drain.begin(0.5, bound_s=None)
    thread.join(30)
    drained_s = time.monotonic() - began
    assert not thread.is_alive() and outcome[0].end == ShardEnd.HANDED_BACK
    assert 0.5 <= drained_s < 10, drained_s  # waited for the drain to be due, no longer

    (row,) = shard_rows(batch_id)
    assert (row.status, row.attempts, row.handbacks) == (ShardStatus.PENDING, 1, 1)
    assert (row.worker, row.heartbeat_at) == (None, None)  # claimable now, by anyone
    assert 5 <= row.done_requests < len(ids)
    assert row.released_at is not None  # it keeps its release slot
    assert f"[{shard.id}]" in _sent_shards(redis_url)
    # The draining attempt is fenced off: a late commit of it cannot land.
    with pytest.raises(ShardLost):
        commit_chunk(row, 1, row.num_chunks, Pending())

    _resume_and_finish(batch_id, ids, host, opened)


def test_drain_hands_back_as_soon_as_the_requests_in_flight_finish(
    drain_env, gated_host, redis_url, caplog
):
    from worker.infra.drain import Drain
    from worker.shards.task import ShardEnd

    caplog.set_level(logging.INFO, logger="worker.shards.run")
    host, opened = gated_host
    # The first line holds the engine at once; the shard can feed only a few more.
    ids, lines = _lines(gate_at=0, n=16)
    batch_id = validated_batch(lines)
    (shard,) = shard_rows(batch_id)
    drain = Drain()
    thread, outcome = _run_in_thread(shard.id, host, drain)
    _wait(lambda: host.stats().in_flight >= 1, "the marked line in the engine")
    drain.begin(60, bound_s=None)
    _wait(lambda: " drains: " in caplog.text, "the shard to see the drain")
    began = time.monotonic()
    opened.set()  # what is in flight now finishes
    thread.join(30)
    assert not thread.is_alive() and outcome[0].end == ShardEnd.HANDED_BACK
    assert time.monotonic() - began < 30  # not the drain's 60 s
    (row,) = shard_rows(batch_id)
    assert 1 <= row.done_requests < len(ids)  # what was in flight finished and was committed
    assert row.handbacks == 1

    _resume_and_finish(batch_id, ids, host, opened)


def test_a_draining_worker_claims_no_shard(drain_env, host, monkeypatch):
    from celery.exceptions import Reject

    from worker.infra.drain import Drain
    from worker.shards import task
    from worker.shards.task import WorkerDraining, run_shard

    batch_id = validated_batch([chat_line("a", "hi")])
    (shard,) = shard_rows(batch_id)
    drain = Drain()
    drain.begin(60, bound_s=None)
    with pytest.raises(WorkerDraining):
        run_shard(shard.id, host=host, drain=drain)
    # The task puts its message back on the queue, for a worker that stays.
    monkeypatch.setattr(task, "process_drain", lambda: drain)
    monkeypatch.setattr(task.runtime, "host", lambda model: host)
    with pytest.raises(Reject) as rejected:
        task.run_shard_task(shard.id)
    assert rejected.value.requeue
    (row,) = shard_rows(batch_id)
    assert (row.status, row.attempts) == ("pending", 0)


def test_the_drain_exits_the_process_once_past_its_bound():
    from worker.infra.drain import EXIT_UNDRAINED, Drain

    codes: list[int] = []
    exited = threading.Event()
    drain = Drain(exit=lambda code: (codes.append(code), exited.set()))
    assert not drain.started and not drain.time_up()
    drain.begin(0.1, bound_s=0.1)
    drain.begin(60, bound_s=0.1)  # once: a second SIGTERM changes nothing
    assert drain.started
    assert exited.wait(10) and codes == [EXIT_UNDRAINED]
    assert drain.time_up()
