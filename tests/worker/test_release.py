"""Shard release on real Postgres: the per-model bound, the order (priority, then round-robin
across tenants, then across a tenant's batches, then shard index), and concurrent releasers."""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta

import pytest

pytestmark = pytest.mark.services


@pytest.fixture
def model(worker_env, monkeypatch):
    """A model name of this test's own (the database is shared by the whole session); its
    batches are ended afterwards, so no later service sees them as work to release."""
    from sqlalchemy import select, update

    from core.db import session_scope
    from core.models import Batch, Shard
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "3")
    get_settings.cache_clear()
    name = f"rel-{secrets.token_hex(4)}"
    yield name
    with session_scope() as session:
        mine = select(Batch.id).where(Batch.model.like(f"{name}%")).scalar_subquery()
        session.execute(update(Shard).where(Shard.batch_id.in_(mine)).values(status="closed"))
        session.execute(
            update(Batch).where(Batch.model.like(f"{name}%")).values(status="cancelled")
        )


def add_batch(model: str, tenant: str, shards: int, *, priority: str = "normal", age_s: float = 0):
    """An in-progress batch of ``model`` with ``shards`` pending shards; its id."""
    from core import ids
    from core.db import session_scope
    from core.lifecycle import now
    from core.models import Batch, File, Shard

    file_id, batch_id = ids.file_id(), ids.batch_id()
    created = now() - timedelta(seconds=age_s)
    with session_scope() as session:
        session.add(File(id=file_id, purpose="batch", filename="x", bytes=0, storage_key="k"))
        session.flush()
        session.add(
            Batch(
                id=batch_id,
                tenant=tenant,
                endpoint="/v1/chat/completions",
                model=model,
                input_file_id=file_id,
                completion_window="24h",
                status="in_progress",
                priority=priority,
                created_at=created,
                expires_at=created + timedelta(hours=24),
            )
        )
        session.flush()
        for i in range(shards):
            session.add(
                Shard(
                    batch_id=batch_id,
                    index=i,
                    status="pending",
                    start_line=i + 1,
                    end_line=i + 2,
                    start_offset=i,
                    end_offset=i + 1,
                    num_requests=1,
                )
            )
    return batch_id


def released(model: str) -> list[tuple[str, int]]:
    """(batch id, shard index) of released-and-unfinished shards, in release order."""
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Batch, Shard

    with session_scope() as session:
        rows = session.execute(
            select(Shard.batch_id, Shard.index)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(
                Batch.model == model,
                Shard.released_at.is_not(None),
                Shard.status.in_(("pending", "running")),
            )
            .order_by(Shard.released_at, Shard.id)
        ).all()
    return [tuple(r) for r in rows]


def finish(batch_id: str, index: int) -> None:
    from sqlalchemy import update

    from core.db import session_scope
    from core.models import Shard

    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.batch_id == batch_id, Shard.index == index)
            .values(status="done")
        )


def queued_messages(model: str) -> int:
    import redis

    from core.queue import model_queue
    from core.settings import get_settings

    return redis.Redis.from_url(get_settings().broker_url).llen(model_queue(model))


def release_order(model: str, steps: int) -> list[tuple[str, int]]:
    """Release one shard at a time (each finishes before the next is released)."""
    from worker.release import release_for_model

    order = []
    for _ in range(steps):
        assert release_for_model(model) == 1
        (shard,) = released(model)
        order.append(shard)
        finish(*shard)
    return order


def test_bound_is_respected_and_freed_slots_are_refilled(model):
    from worker.release import release_for_model

    batch = add_batch(model, "t1", 10)
    assert release_for_model(model) == 3
    assert released(model) == [(batch, 0), (batch, 1), (batch, 2)]
    assert queued_messages(model) == 3
    assert release_for_model(model) == 0  # full: nothing more
    finish(batch, 1)
    assert release_for_model(model) == 1
    assert [i for _, i in released(model)] == [0, 2, 3]
    # A running shard still holds its slot.
    from sqlalchemy import update

    from core.db import session_scope
    from core.models import Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.batch_id == batch).values(status="running"))
    assert release_for_model(model) == 0
    assert queued_messages(model) == 4


def test_round_robin_across_tenants_and_batches_one_slot_at_a_time(model, monkeypatch):
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "1")
    get_settings.cache_clear()
    a1 = add_batch(model, "tenant-a", 4, age_s=30)  # tenant a: a big old job and a newer one
    a2 = add_batch(model, "tenant-a", 2, age_s=20)
    b1 = add_batch(model, "tenant-b", 2, age_s=10)
    # Tenants alternate (the one served longest ago goes next), and so do a tenant's batches.
    assert release_order(model, 8) == [
        (a1, 0),
        (b1, 0),
        (a2, 0),
        (b1, 1),
        (a1, 1),
        (a2, 1),
        (a1, 2),
        (a1, 3),
    ]


def test_a_small_job_gets_the_first_free_slot_behind_a_big_one(model):
    from worker.release import release_for_model

    big = add_batch(model, "tenant-a", 10, age_s=60)
    assert release_for_model(model) == 3
    small = add_batch(model, "tenant-b", 2)
    assert release_for_model(model) == 0  # every slot is taken
    finish(big, 0)
    assert release_for_model(model) == 1
    assert released(model)[-1] == (small, 0)  # tenant-b holds none: it goes first
    finish(big, 1)
    assert release_for_model(model) == 1
    # One each in flight: tenant-a was served longest ago.
    assert released(model)[-1] == (big, 3)
    finish(small, 0)
    assert release_for_model(model) == 1
    assert released(model)[-1] == (small, 1)


def test_slots_spread_over_tenants_then_over_a_tenants_batches(model):
    from worker.release import release_for_model

    a1 = add_batch(model, "tenant-a", 6, age_s=30)
    a2 = add_batch(model, "tenant-a", 6, age_s=20)
    b1 = add_batch(model, "tenant-b", 6, age_s=10)
    c1 = add_batch(model, "tenant-c", 6, age_s=5)
    assert release_for_model(model) == 3
    assert set(released(model)) == {(a1, 0), (b1, 0), (c1, 0)}  # one per tenant
    finish(a1, 0)
    assert release_for_model(model) == 1
    assert released(model)[-1] == (a2, 0)  # tenant-a again, now its other batch

    other = f"{model}-x"  # a single tenant's batches alone, on a fresh model
    x1 = add_batch(other, "tenant-x", 4, age_s=30)
    x2 = add_batch(other, "tenant-x", 4, age_s=20)
    assert release_for_model(other) == 3
    assert set(released(other)) == {(x1, 0), (x2, 0), (x1, 1)}
    finish(x1, 0)
    assert release_for_model(other) == 1
    # x1 and x2 hold one each; x2 was served longest ago.
    assert released(other)[-1] == (x2, 1)


def test_priority_first_then_fairness(model, monkeypatch):
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "1")
    get_settings.cache_clear()
    low = add_batch(model, "tenant-a", 2, priority="low", age_s=40)
    normal = add_batch(model, "tenant-a", 2, priority="normal", age_s=30)
    high_b = add_batch(model, "tenant-b", 1, priority="high", age_s=5)
    high_a = add_batch(model, "tenant-a", 2, priority="high", age_s=1)
    order = release_order(model, 7)
    assert order == [
        (high_b, 0),  # high first; b is older than a's high batch
        (high_a, 0),
        (high_a, 1),
        (normal, 0),
        (normal, 1),
        (low, 0),
        (low, 1),
    ]


def test_high_priority_overtakes_a_running_bulk_job(model):
    from worker.release import release_for_model

    bulk = add_batch(model, "tenant-a", 10, age_s=60)
    assert release_for_model(model) == 3
    urgent = add_batch(model, "tenant-a", 2, priority="high")
    assert release_for_model(model) == 0
    finish(bulk, 0)
    assert release_for_model(model) == 1
    assert released(model)[-1] == (urgent, 0)
    finish(bulk, 1)
    finish(bulk, 2)
    assert release_for_model(model) == 2
    assert set(released(model)[-2:]) == {(urgent, 1), (bulk, 3)}
    finish(urgent, 0)
    finish(urgent, 1)
    assert release_for_model(model) == 2
    assert set(released(model)) == {(bulk, i) for i in (3, 4, 5)}


def test_batches_not_in_progress_or_expired_are_not_released(model):
    from sqlalchemy import update

    from core.db import session_scope
    from core.lifecycle import now
    from core.models import Batch
    from worker.release import release_for_model

    cancelling = add_batch(model, "t", 2)
    expired = add_batch(model, "t", 2)
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == cancelling).values(status="cancelling"))
        session.execute(
            update(Batch).where(Batch.id == expired).values(expires_at=now() - timedelta(1))
        )
    assert release_for_model(model) == 0
    assert released(model) == []


def test_concurrent_releasers_never_exceed_the_bound(model, monkeypatch):
    from core.settings import get_settings
    from worker.release import release_for_model

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "5")
    get_settings.cache_clear()
    batches = [add_batch(model, f"tenant-{i % 3}", 12) for i in range(6)]
    total_sent = 0
    for _round in range(6):
        barrier = threading.Barrier(8)
        sent: list[int] = []
        errors: list[BaseException] = []

        def go(barrier=barrier, sent=sent, errors=errors) -> None:
            try:
                barrier.wait()
                sent.append(release_for_model(model))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        total_sent += sum(sent)
        live = released(model)
        assert len(live) == 5, live
        assert len(set(live)) == 5
        # Finish two of them, so the next round has slots to fight over.
        for shard in live[:2]:
            finish(*shard)
    assert total_sent == 5 + 5 * 2
    assert queued_messages(model) == total_sent
    assert {b for b, _ in released(model)} <= set(batches)


def test_sweep_resends_a_release_that_was_never_sent(model):
    from sqlalchemy import update

    from core.db import session_scope
    from core.lifecycle import now
    from core.models import Shard
    from worker.release import _resend_lost, release_for_model

    batch = add_batch(model, "t", 5)
    assert release_for_model(model) == 3
    long_ago = now() - timedelta(hours=2)
    with session_scope() as session:
        # Shard 0: released, never claimed, silent for hours (its message was lost).
        # Shard 1: the same, but a worker claimed it once (recovery re-sends those).
        for index, attempts in ((0, 0), (1, 1)):
            session.execute(
                update(Shard)
                .where(Shard.batch_id == batch, Shard.index == index)
                .values(released_at=long_ago, updated_at=long_ago, attempts=attempts)
            )
    assert _resend_lost(model) == 1
    assert queued_messages(model) == 4
    assert _resend_lost(model) == 0  # its release time was renewed
    assert len(released(model)) == 3  # still within the bound
