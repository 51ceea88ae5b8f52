"""Crash recovery at the worker level, on real Postgres, Redis, local storage and an
in-process engine host: claims that respect a live attempt, the heartbeat thread, the reclaim
sweep, giving up after max_shard_attempts, per-request engine failures retried alone, and a
database outage in the middle of a shard (through a TCP proxy)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
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


class Interrupted(Exception):
    pass


def _age_heartbeat(shard_id: int, seconds: float = 3600) -> None:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.id == shard_id)
            .values(heartbeat_at=Shard.heartbeat_at - timedelta(seconds=seconds))
        )


def _set_shard(shard_id: int, **values: Any) -> None:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(**values))


def _one_line_each(batch_id: str, ids: list[str]) -> tuple[list[dict], list[dict]]:
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    got = [r["custom_id"] for r in out] + [r["custom_id"] for r in err]
    assert sorted(got) == sorted(ids), "exactly one line per request"
    return out, err


def _contents(lines: list[dict]) -> dict[str, str]:
    return {
        r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in lines
    }


@pytest.fixture(scope="module")
def fault_host() -> Iterator[Any]:
    """A host whose engine fails every step while a prompt containing POISONPILL is in it, and
    refuses prompts containing REFUSEME (tests.worker.shards.engine_faults)."""
    from core.llms.demo import build
    from engine import Engine, EngineHost
    from tests.worker.shards.engine_faults import install_test_fault

    engine = Engine(str(build("llama-tiny")), max_num_seqs=4)
    install_test_fault(engine, "step:POISONPILL")
    install_test_fault(engine, "request:REFUSEME")
    h = EngineHost(engine).start()
    yield h
    h.shutdown(wait=True, abort_pending=True, timeout=30)


def test_claim_leaves_a_live_attempt_alone(worker_env):
    from worker.shards.task import claim

    batch_id = validated_batch([chat_line("a", "hi")])
    (shard,) = shard_rows(batch_id)
    first, _ = claim(shard.id, "w1")
    assert claim(shard.id, "w2") is None  # a duplicate delivery while w1 is alive
    assert claim(shard.id, "w1") == (first + 1, 0)  # w1's own retried claim
    _age_heartbeat(shard.id)
    assert claim(shard.id, "w2") == (first + 2, 0)  # w1 went silent


def test_reclaim_requeues_a_silent_shard_which_resumes_from_its_checkpoint(
    worker_env, host, redis_url
):
    import redis

    from core.broker.queue import model_queue
    from worker.batches.finalize import finalize
    from worker.shards.recovery import reclaim_stale_shards
    from worker.shards.task import ShardEnd, claim, run_shard

    ids = [f"r{i}" for i in range(10)]
    batch_id = validated_batch([chat_line(c, f"tell me about {c}", max_tokens=5) for c in ids])
    (shard,) = shard_rows(batch_id)

    def die(chunk: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=die)  # the first result committed
    # As if the worker had been SIGKILLed instead: running, fresh heartbeat, no thread.
    assert claim(shard.id, "killed-worker", force=True) is not None
    assert shard.id not in reclaim_stale_shards().requeued  # not silent long enough yet
    _age_heartbeat(shard.id, 120)
    client = redis.Redis.from_url(redis_url)
    client.delete(model_queue(MODEL))
    report = reclaim_stale_shards()
    assert shard.id in report.requeued and shard.id not in report.failed
    (row,) = shard_rows(batch_id)
    assert (row.status, row.attempts, row.num_chunks) == ("pending", 2, 1)
    sent = [json.loads(m)["headers"] for m in client.lrange(model_queue(MODEL), 0, -1)]
    assert {"task": "batchd.run_shard", "argsrepr": f"[{shard.id}]"} in [
        {"task": h["task"], "argsrepr": h["argsrepr"]} for h in sent
    ]
    assert shard.id not in reclaim_stale_shards().requeued  # once

    outcome = run_shard(shard.id, host=host)
    assert (outcome.end, outcome.ran) == (ShardEnd.DONE, 9)  # only what was not committed
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, ids)
    assert not err and [r["custom_id"] for r in out] == ids


def test_shard_given_up_after_max_attempts_reports_shard_failed(worker_env, host):
    from core.settings import get_settings
    from worker.batches.finalize import finalize
    from worker.shards.recovery import reclaim_stale_shards
    from worker.shards.task import ShardEnd, run_shard

    ids = [f"q{i}" for i in range(10)]
    batch_id = validated_batch(
        [chat_line(c, f"question {c}", max_tokens=4) for c in ids], shard_max_requests=5
    )
    first, second = shard_rows(batch_id)

    def die(chunk: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(second.id, host=host, after_commit=die)  # 1 of 5 committed (q5)
    _set_shard(second.id, attempts=get_settings().max_shard_attempts)
    report = reclaim_stale_shards()  # abandoned (no heartbeat) and out of attempts
    assert second.id in report.failed and second.id not in report.requeued
    row = shard_rows(batch_id)[1]
    assert (row.status, row.done_requests) == ("done", 5)
    assert batch_row(batch_id).status == "in_progress"  # the first shard still runs
    assert run_shard(first.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, ids)
    assert len(out) == 6
    assert len(err) == 4 and {r["custom_id"] for r in out} >= {f"q{i}" for i in range(5)}
    for failed in err:
        assert failed["response"]["status_code"] == 500
        error = failed["response"]["body"]["error"]
        assert error["code"] == "shard_failed" and "max_shard_attempts" in error["message"]
    batch = batch_row(batch_id)
    assert (batch.request_completed, batch.request_failed) == (6, 4)


def test_redelivered_task_past_max_attempts_fails_the_rest(worker_env, host):
    from core.settings import get_settings
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    ids = ["x0", "x1", "x2"]
    batch_id = validated_batch([chat_line(c, "hello", max_tokens=3) for c in ids])
    (shard,) = shard_rows(batch_id)
    _set_shard(shard.id, attempts=get_settings().max_shard_attempts)
    assert run_shard(shard.id, host=host).end == ShardEnd.FAILED
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, ids)
    assert not out and {r["response"]["body"]["error"]["code"] for r in err} == {"shard_failed"}


def test_heartbeat_thread_beats_and_stops_a_reclaimed_attempt(worker_env, monkeypatch):
    from core.llms.demo import build
    from core.settings import get_settings
    from engine import Engine, EngineHost
    from testkit import engine_gate
    from worker.shards.task import ShardEnd, run_shard

    monkeypatch.setenv("BATCHD_HEARTBEAT_INTERVAL_S", "0.2")
    monkeypatch.setenv("BATCHD_CHECKPOINT_EVERY", "1000")
    get_settings.cache_clear()
    # The last line holds the engine (its gate never opens): the shard runs until the
    # reclaim, however fast the machine.
    lines = [chat_line(f"h{i}", f"story {i}", max_tokens=16, ignore_eos=True) for i in range(11)]
    lines.append(chat_line("h11", f"story {engine_gate.marker('beats')}", 16, ignore_eos=True))
    batch_id = validated_batch(lines)
    (shard,) = shard_rows(batch_id)
    engine = Engine(str(build("llama-tiny")))
    engine_gate.install(engine, lambda name: True)
    host = EngineHost(engine).start()
    outcome: list[Any] = []
    t = threading.Thread(target=lambda: outcome.append(run_shard(shard.id, host=host)))
    t.start()
    beats = []
    deadline = time.monotonic() + 30
    while len(set(beats)) < 3 and time.monotonic() < deadline:
        row = shard_rows(batch_id)[0]
        if row.status == "running" and row.heartbeat_at is not None:
            beats.append(row.heartbeat_at)
        time.sleep(0.1)
    assert len(set(beats)) >= 3, "heartbeat_at advances while the shard runs"
    # A reclaim takes the shard away: the attempt notices through its heartbeat and stops.
    stopped_at = time.monotonic()
    _set_shard(shard.id, status="pending")
    t.join(30)
    assert not t.is_alive() and outcome[0].end == ShardEnd.LOST
    assert time.monotonic() - stopped_at < 5
    assert shard_rows(batch_id)[0].num_chunks == 0  # nothing committed by the fenced attempt
    host.shutdown(wait=True, abort_pending=True, timeout=30)


def test_step_failure_retries_each_request_alone(worker_env, host, fault_host):
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    texts = {f"s{i}": f"short story number {i}" for i in range(7)}
    texts["poison"] = "a POISONPILL story"
    order = ["s0", "s1", "s2", "poison", "s3", "s4", "s5", "s6"]
    lines = [chat_line(c, texts[c], max_tokens=10) for c in order]
    batch_id = validated_batch(lines)
    (shard,) = shard_rows(batch_id)
    before = fault_host.stats()
    outcome = run_shard(shard.id, host=fault_host)
    assert outcome.end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, order)
    (bad,) = err
    assert bad["custom_id"] == "poison" and bad["response"]["status_code"] == 500
    message = bad["response"]["body"]["error"]["message"]
    assert "RuntimeError" in message and "run alone" in message
    assert "injected test fault" not in message  # internals stay in the worker's log
    stats = fault_host.stats()
    # The poison request failed once with company, then max_request_attempts (2) times alone.
    assert stats.step_errors - before.step_errors == 3

    # The bystanders that were retried give exactly what an undisturbed run gives.
    clean_id = validated_batch(
        [chat_line(c, texts[c], max_tokens=10) for c in order if c != "poison"]
    )
    (clean,) = shard_rows(clean_id)
    assert run_shard(clean.id, host=host).end == ShardEnd.DONE
    assert finalize(clean_id) == "completed"
    clean_out, _ = _one_line_each(clean_id, [c for c in order if c != "poison"])
    assert _contents(out) == _contents(clean_out)


def test_request_error_is_retried_then_reported(worker_env, fault_host):
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    order = ["ok0", "refused", "ok1"]
    lines = [
        chat_line(c, "REFUSEME please" if c == "refused" else "hi", max_tokens=4) for c in order
    ]
    batch_id = validated_batch(lines)
    (shard,) = shard_rows(batch_id)
    before = fault_host.stats()
    assert run_shard(shard.id, host=fault_host).end == ShardEnd.DONE
    assert fault_host.stats().failed - before.failed == 2  # max_request_attempts tries
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, order)
    assert [r["custom_id"] for r in out] == ["ok0", "ok1"]
    (bad,) = err
    assert bad["custom_id"] == "refused" and bad["response"]["status_code"] == 400


def test_database_outage_mid_shard_is_ridden_out(worker_env, host, pg_url, monkeypatch):

    from core.database import sessions
    from core.settings import get_settings
    from testkit.proxies.tcp_proxy import TcpProxy
    from tests.conftest import PG_HOST, PG_PORT
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    def use_database(url: str) -> None:
        monkeypatch.setenv("BATCHD_DATABASE_URL", url)
        get_settings.cache_clear()
        sessions.get_engine(None).dispose()
        sessions.get_engine.cache_clear()  # sessions without a URL use the settings' database
        sessions._sessionmaker.cache_clear()

    ids = [f"d{i}" for i in range(16)]
    batch_id = validated_batch([chat_line(c, f"outage {c}", max_tokens=12) for c in ids])
    (shard,) = shard_rows(batch_id)
    proxy = TcpProxy(PG_HOST, PG_PORT).start()
    try:
        monkeypatch.setenv("BATCHD_HEARTBEAT_INTERVAL_S", "0.3")
        use_database(proxy.url_for(pg_url, PG_PORT))
        cut: list[threading.Thread] = []

        def outage_after_first(chunk: int) -> None:
            if chunk == 1:
                cut.append(proxy.outage(3.0))

        started = time.monotonic()
        outcome = run_shard(shard.id, host=host, after_commit=outage_after_first)
        took = time.monotonic() - started
        assert outcome.end == ShardEnd.DONE and outcome.ran == 16
        assert cut and proxy.refused > 0, "the shard hit the outage"
        assert took >= 3.0
    finally:
        use_database(pg_url)
        proxy.close()
    assert batch_row(batch_id).status == "finalizing"
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_id, ids)
    assert not err
    (row,) = shard_rows(batch_id)
    assert row.attempts == 1  # the same attempt carried on
