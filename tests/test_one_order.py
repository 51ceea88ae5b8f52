"""The shard release window (``worker.shards.release.choose``) and the engine host's fair queue
(``engine.host.fair_queue.FairQueue``, which the upstream dispatcher uses too) apply one order,
``engine.host.order.flow_key``: given the same work, all of it waiting and none of it finishing,
they serve it in the same order, shard for request.

They differ in what they count as a tenant's tokens (the window: what it holds in flight, over
every tier; the queue: what it was charged in a tier since it became active), so each tenant
here keeps to one tier."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from core.batches.priority import Priority
from engine.host.fair_queue import FairQueue
from worker.shards.release import Candidate, Load, choose

T0 = datetime(2030, 1, 1, tzinfo=UTC)
TIER = {"a": "normal", "b": "normal", "c": "high", "d": "low"}


@dataclass(eq=False)
class Request:
    tenant: str
    group: str
    cost: int
    priority: int
    deadline: float | None
    rank: int  # the shard's index: a batch's own order, as the window's

    @property
    def flow(self) -> tuple[str, str, int]:
        return self.tenant, self.group, self.priority


# (batch, tenant, deadline in seconds after T0 or None, cost of each shard, shards), in the
# order they arrive.
Batch = tuple[str, str, float | None, int, int]


def both_orders(batches: list[Batch]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    candidates, queue = [], FairQueue()
    for k, (batch, tenant, deadline_s, cost, n) in enumerate(batches):
        created = T0 + timedelta(seconds=k)
        deadline = None if deadline_s is None else T0 + timedelta(seconds=deadline_s)
        for i in range(n):
            candidates.append(
                Candidate(shard_id=hash((batch, i)), index=i, batch_id=batch, tenant=tenant,
                          priority=TIER[tenant], created_at=created, cost=cost,
                          started_at=created, deadline=deadline)
            )  # fmt: skip
            queue.push(
                Request(tenant, batch, cost, Priority(TIER[tenant]).engine,
                        None if deadline is None else deadline.timestamp(), i)
            )  # fmt: skip
    released = choose(candidates, len(candidates), Load(), clock=T0.timestamp())
    admitted = []
    while (request := queue.pop()) is not None:
        admitted.append((request.group, request.rank))
    return [(c.batch_id, c.index) for c in released], admitted


def test_tenants_batches_deadlines_and_tiers_come_out_in_one_order() -> None:
    batches: list[Batch] = [
        ("a-day", "a", 86400, 100, 6),
        ("b-big", "b", 86400, 300, 4),
        ("a-hour", "a", 3600, 50, 3),
        ("b-none", "b", None, 100, 3),
        ("b-none2", "b", None, 200, 3),
        ("c-urgent", "c", 86400, 100, 2),
        ("d-bulk", "d", None, 10, 2),
    ]
    released, admitted = both_orders(batches)
    assert released == admitted
    tenants = [b.split("-")[0] for b, _ in admitted]
    assert tenants[:2] == ["c", "c"] and tenants[-2:] == ["d", "d"]
    assert [b for b, _ in admitted if b.startswith("a")][:3] == ["a-hour"] * 3  # deadline first


@pytest.mark.parametrize("seed", range(40))
def test_any_mix_comes_out_in_one_order(seed: int) -> None:
    rnd = random.Random(seed)
    batches: list[Batch] = [
        (f"batch{k}", rnd.choice("abcd"), rnd.choice([None, 1000.0, 2000.0]),
         rnd.choice([1, 50, 100, 300]), rnd.randint(1, 6))
        for k in range(rnd.randint(2, 8))
    ]  # fmt: skip
    released, admitted = both_orders(batches)
    assert released == admitted, batches
