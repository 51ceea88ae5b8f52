"""Shard release: the policy as a pure function (:func:`worker.shards.release.choose`: ``low`` aging
into ``normal``, tenants sharing by tokens, engine.host.order), and on real Postgres the
per-model bound, the order (priority, then round-robin across tenants, then across a tenant's
batches, then shard index), and concurrent releasers."""

from __future__ import annotations

import secrets
import threading
from datetime import UTC, datetime, timedelta

import pytest

from worker.shards.release import Candidate, Load, choose

services = pytest.mark.services

# ---------------------------------------------------------------------------------------------
# The policy, pure

T0 = datetime(2030, 1, 1, tzinfo=UTC)
CLOCK = T0.timestamp() + 3600.0  # "now" in the pure tests: an hour after T0
# One deadline for the database tests' batches unless a test gives its own: batches with equal
# deadlines share their tenant's slots (earliest deadline first orders the others).
SHARED_DEADLINE = datetime.now(UTC).replace(microsecond=0) + timedelta(days=2)


def shards(
    batch: str, tenant: str, n: int, *, priority="normal", cost=1, started_s=0.0, deadline_s=None
):
    """``n`` candidates of one batch that started running ``started_s`` seconds after T0 (and
    is due ``deadline_s`` seconds after T0; None: no deadline)."""
    started = T0 + timedelta(seconds=started_s)
    deadline = None if deadline_s is None else T0 + timedelta(seconds=deadline_s)
    return [
        Candidate(
            shard_id=hash((batch, i)),
            index=i,
            batch_id=batch,
            tenant=tenant,
            priority=priority,
            created_at=started,
            cost=cost,
            started_at=started,
            deadline=deadline,
        )
        for i in range(n)
    ]


def picks(chosen) -> list[tuple[str, int]]:
    return [(c.batch_id, c.index) for c in chosen]


def test_a_low_batch_waiting_longer_than_the_aging_time_competes_as_normal():
    waited = shards("low", "t-low", 2, priority="low", started_s=3600 - 61)  # waited 61 s
    fresh_normal = shards("normal", "t-normal", 2, started_s=3600 - 1)
    candidates = waited + fresh_normal
    # Aged: it competes as normal, and is the one of the two served longest ago (never, and
    # older). Once served, its wait starts again and the normal batch goes first.
    chosen = choose(candidates, 3, Load(), aging_s=60, clock=CLOCK)
    assert picks(chosen) == [("low", 0), ("normal", 0), ("normal", 1)]
    # Not aged yet (or no aging): strictly behind normal.
    assert picks(choose(candidates, 1, Load(), aging_s=120, clock=CLOCK)) == [("normal", 0)]
    assert picks(choose(candidates, 1, Load(), aging_s=None, clock=CLOCK)) == [("normal", 0)]
    # The wait counts from its last release: released 10 s ago, it is low again.
    served = Load(batch_last={"low": CLOCK - 10}, tenant_last={"t-low": CLOCK - 10})
    assert picks(choose(candidates, 1, served, aging_s=60, clock=CLOCK)) == [("normal", 0)]
    # ... and released 61 s ago it has waited long enough again: it competes as normal, and
    # is served before the normal tenant served 5 s ago.
    served = Load(
        batch_last={"low": CLOCK - 61, "normal": CLOCK - 5},
        tenant_last={"t-low": CLOCK - 61, "t-normal": CLOCK - 5},
    )
    assert picks(choose(candidates, 1, served, aging_s=60, clock=CLOCK)) == [("low", 0)]


def test_aging_lifts_low_to_normal_never_above():
    aged_low = shards("low", "t-low", 1, priority="low", started_s=0)  # waited an hour
    high = shards("high", "t-high", 1, priority="high", started_s=3599)
    chosen = choose(aged_low + high, 2, Load(), aging_s=1, clock=CLOCK)
    assert picks(chosen) == [("high", 0), ("low", 0)]


def test_two_tenants_in_a_tier_share_by_shard_tokens():
    small = shards("a1", "tenant-a", 10, cost=100, started_s=0)
    big = shards("b1", "tenant-b", 10, cost=300, started_s=1)
    chosen = choose(small + big, 8, Load(), aging_s=60, clock=CLOCK)
    # The tenant holding fewer released tokens goes next; at equal tokens, the one served
    # longest ago. Tenant a's 100-token shards get three slots for each of b's 300-token one.
    assert [c.tenant for c in chosen] == ["tenant-a", "tenant-b", "tenant-a", "tenant-a",
                                          "tenant-b", "tenant-a", "tenant-a", "tenant-a"]  # fmt: skip
    tokens = {t: sum(c.cost for c in chosen if c.tenant == t) for t in ("tenant-a", "tenant-b")}
    assert tokens == {"tenant-a": 600, "tenant-b": 600}
    assert [i for b, i in picks(chosen) if b == "a1"] == list(range(6))  # index order
    # The share carries over between calls through what is in flight: with tenant a holding
    # 600 released tokens and b 300, b's next shard goes first (600 each), then a, served
    # longest ago (700), then b (900), then a (800).
    load = Load(
        tenant_tokens={"tenant-a": 600, "tenant-b": 300},
        batch_tokens={"a1": 600, "b1": 300},
        tenant_last={"tenant-a": CLOCK - 1, "tenant-b": CLOCK - 2},
        batch_last={"a1": CLOCK - 1, "b1": CLOCK - 2},
    )
    chosen = choose(small[6:] + big[2:], 4, load, aging_s=60, clock=CLOCK)
    assert picks(chosen) == [("b1", 2), ("a1", 6), ("b1", 3), ("a1", 7)]


def test_within_a_tenant_the_earliest_deadline_goes_first():
    # A day-long job that started first, then a one-hour job: the one-hour job's shards go
    # first within the tenant; the other tenant keeps its share (tenants alternate).
    day = shards("day", "tenant-x", 3, started_s=0, deadline_s=86400)
    hour = shards("hour", "tenant-x", 3, started_s=5, deadline_s=3605)
    other = shards("y", "tenant-y", 3, started_s=1, deadline_s=86401)
    chosen = choose(day + hour + other, 6, Load(), aging_s=60, clock=CLOCK)
    assert [b for b, _ in picks(chosen) if b != "y"] == ["hour", "hour", "hour"]
    assert [b for b, _ in picks(chosen)].count("y") == 3
    assert picks(choose(day + hour, 4, Load(), clock=CLOCK)) == [
        ("hour", 0), ("hour", 1), ("hour", 2), ("day", 0)
    ]  # fmt: skip


def test_within_a_tenant_batches_share_by_tokens_too():
    one = shards("x1", "tenant-x", 4, cost=200, started_s=0)
    two = shards("x2", "tenant-x", 4, cost=100, started_s=1)
    chosen = choose(one + two, 4, Load(), aging_s=60, clock=CLOCK)
    assert picks(chosen) == [("x1", 0), ("x2", 0), ("x2", 1), ("x1", 1)]


# ---------------------------------------------------------------------------------------------
# On the database


@pytest.fixture
def model(worker_env, monkeypatch):
    """A model name of this test's own (the database is shared by the whole session); its
    batches are ended afterwards, so no later service sees them as work to release."""
    from sqlalchemy import select, update

    from core.database.sessions import session_scope
    from core.database.tables import Batch, Shard
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


def add_batch(
    model: str,
    tenant: str,
    shards: int,
    *,
    priority: str = "normal",
    age_s: float = 0,
    est_tokens: int = 0,
    deadline: datetime | None = None,
):
    """An in-progress batch of ``model`` with ``shards`` pending shards (each of
    ``est_tokens``), started ``age_s`` seconds ago; its id."""
    from core.batches import ids
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File, Shard

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
                in_progress_at=created,
                expires_at=deadline or SHARED_DEADLINE,
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
                    est_tokens=est_tokens,
                )
            )
    return batch_id


def released(model: str) -> list[tuple[str, int]]:
    """(batch id, shard index) of released-and-unfinished shards, in release order."""
    from sqlalchemy import select

    from core.database.sessions import session_scope
    from core.database.tables import Batch, Shard

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

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.batch_id == batch_id, Shard.index == index)
            .values(status="done")
        )


def queued_messages(model: str) -> int:
    import redis

    from core.broker.queue import model_queue
    from core.settings import get_settings

    return redis.Redis.from_url(get_settings().broker_url).llen(model_queue(model))


def release_order(model: str, steps: int) -> list[tuple[str, int]]:
    """Release one shard at a time (each finishes before the next is released)."""
    from worker.shards.release import release_for_model

    order = []
    for _ in range(steps):
        assert release_for_model(model) == 1
        (shard,) = released(model)
        order.append(shard)
        finish(*shard)
    return order


@services
def test_bound_is_respected_and_freed_slots_are_refilled(model):
    from worker.shards.release import release_for_model

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

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.batch_id == batch).values(status="running"))
    assert release_for_model(model) == 0
    assert queued_messages(model) == 4


@services
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


@services
def test_a_small_job_gets_the_first_free_slot_behind_a_big_one(model):
    from worker.shards.release import release_for_model

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


@services
def test_slots_spread_over_tenants_then_over_a_tenants_batches(model):
    from worker.shards.release import release_for_model

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


@services
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


@services
def test_high_priority_overtakes_a_running_bulk_job(model):
    from worker.shards.release import release_for_model

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


@services
def test_batches_not_in_progress_or_expired_are_not_released(model):
    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from worker.shards.release import release_for_model

    cancelling = add_batch(model, "t", 2)
    expired = add_batch(model, "t", 2)
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == cancelling).values(status="cancelling"))
        session.execute(
            update(Batch).where(Batch.id == expired).values(expires_at=now() - timedelta(1))
        )
    assert release_for_model(model) == 0
    assert released(model) == []


@services
def test_concurrent_releasers_never_exceed_the_bound(model, monkeypatch):
    from core.settings import get_settings
    from worker.shards.release import release_for_model

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


@services
def test_sweep_resends_a_release_that_was_never_sent(model):
    from sqlalchemy import update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Shard
    from worker.shards.release import _resend_lost, release_for_model

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


@services
def test_a_low_batch_is_not_starved_by_steady_normal_work(model, monkeypatch):
    """One slot, always refilled with normal work: the low batch, once it has waited longer
    than the aging time, gets the next slot; then it waits its aging time again."""
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "1")
    monkeypatch.setenv("BATCHD_LOW_PRIORITY_AGING_S", "60")
    get_settings.cache_clear()
    low = add_batch(model, "tenant-a", 2, priority="low", age_s=120)
    normal = add_batch(model, "tenant-b", 3, age_s=5)
    fresh_low = add_batch(model, "tenant-c", 1, priority="low", age_s=10)
    assert release_order(model, 6) == [
        (low, 0),  # waited 120 s > 60 s: competes as normal, and was served longest ago
        (normal, 0),  # released just now, the low batch waits again
        (normal, 1),
        (normal, 2),
        (fresh_low, 0),  # then the low tier, round-robin: tenant-c was never served
        (low, 1),
    ]


@services
def test_tenants_share_released_slots_by_tokens(model, monkeypatch):
    from core.settings import get_settings
    from worker.shards.release import release_for_model

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "4")
    get_settings.cache_clear()
    small = add_batch(model, "tenant-a", 6, age_s=20, est_tokens=100)
    big = add_batch(model, "tenant-b", 6, age_s=10, est_tokens=300)
    assert release_for_model(model) == 4
    assert released(model) == [(small, 0), (big, 0), (small, 1), (small, 2)]
    finish(big, 0)  # tenant b holds nothing now: it goes next
    assert release_for_model(model) == 1
    assert released(model)[-1] == (big, 1)
    finish(small, 0)  # a: 200 tokens, b: 300
    assert release_for_model(model) == 1
    assert released(model)[-1] == (small, 3)


@services
def test_a_tenants_one_hour_job_is_released_before_its_day_long_job(model, monkeypatch):
    from core.database.lifecycle import now
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MAX_RELEASED_SHARDS_PER_MODEL", "1")
    get_settings.cache_clear()
    day = add_batch(model, "tenant-a", 3, age_s=5, deadline=now() + timedelta(hours=24))
    hour = add_batch(model, "tenant-a", 2, deadline=now() + timedelta(hours=1))
    other = add_batch(model, "tenant-b", 2, deadline=now() + timedelta(hours=24))
    order = release_order(model, 7)
    mine = [batch for batch, _ in order if batch != other]
    assert mine == [hour, hour, day, day, day]
    # The other tenant keeps its turns: tenants still alternate.
    assert [batch for batch, _ in order[:4]].count(other) == 2


@services
def test_a_reclaimed_shard_whose_message_was_lost_does_not_hold_its_slot(model):
    """A shard reclaimed from a silent worker is re-sent and keeps its release slot; when that
    message is lost, no worker ever claims it (the broker would give back a message held by a
    killed worker only after its visibility timeout, hours), and the slot sat idle: no other
    shard of the model could take it. The reclaim sweep sends it again once it has stayed
    unclaimed for the resend bound, and only once per bound."""
    import redis
    from sqlalchemy import select, update

    from core.broker.queue import model_queue
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Shard
    from core.settings import get_settings
    from worker.shards.recovery import reclaim_stale_shards
    from worker.shards.release import release_for_model, resend_after_s

    broker = redis.Redis.from_url(get_settings().broker_url)
    batch = add_batch(model, "t", 5)
    assert release_for_model(model) == 3
    with session_scope() as session:
        shard_id = session.scalar(select(Shard.id).where(Shard.batch_id == batch, Shard.index == 0))
    # A worker claimed shard 0, then went silent: the sweep re-queues and re-sends it.
    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.id == shard_id)
            .values(status="running", attempts=1, heartbeat_at=now() - timedelta(hours=1))
        )
    assert shard_id in reclaim_stale_shards().requeued
    broker.delete(model_queue(model))  # ... and every message of the model is lost
    assert release_for_model(model) == 0  # the three slots are held

    def silent_for(seconds: float) -> None:
        long_ago = now() - timedelta(seconds=seconds)
        with session_scope() as session:
            session.execute(update(Shard).where(Shard.id == shard_id).values(updated_at=long_ago))

    silent_for(resend_after_s() / 2)
    assert shard_id not in reclaim_stale_shards().resent  # its message may still be on its way
    assert queued_messages(model) == 0
    silent_for(resend_after_s() + 60)
    assert shard_id in reclaim_stale_shards().resent
    assert queued_messages(model) == 1
    assert shard_id not in reclaim_stale_shards().resent  # once per bound
    assert queued_messages(model) == 1
    assert len(released(model)) == 3  # the bound still holds
