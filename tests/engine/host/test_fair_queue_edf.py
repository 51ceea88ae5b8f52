"""Earliest deadline first inside a tenant's turn (engine.host.fair_queue): a tenant's batch with
the earlier deadline is served before its other batches, tenants still share the tier equally,
and batches without a deadline keep sharing fairly."""

from __future__ import annotations

from dataclasses import dataclass

from engine.host.fair_queue import FairQueue


@dataclass(eq=False)
class E:
    tenant: str
    group: str
    cost: int = 10
    priority: int = 0
    deadline: float | None = None

    @property
    def flow(self):
        return self.tenant, self.group, self.priority


def drain(q: FairQueue) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.group)
    return out


def test_a_tenants_earlier_deadline_runs_first_whatever_arrived_first():
    q = FairQueue()
    for _ in range(3):
        q.push(E("a", "late", deadline=2000.0))
    for _ in range(3):
        q.push(E("a", "soon", deadline=1000.0))
    assert drain(q) == ["soon"] * 3 + ["late"] * 3


def test_without_deadlines_a_tenants_batches_still_alternate():
    q = FairQueue()
    for _ in range(2):
        q.push(E("a", "x"))
        q.push(E("a", "y"))
    assert drain(q) == ["x", "y", "x", "y"]


def test_deadlines_never_take_another_tenants_share():
    q = FairQueue()
    for _ in range(3):
        q.push(E("a", "a-late", deadline=5000.0))
        q.push(E("a", "a-soon", deadline=1.0))
        q.push(E("b", "b-only", deadline=9999.0))
    order = drain(q)
    # Tenants alternate; inside tenant a, its earlier deadline goes first.
    assert order[:6] == ["a-soon", "b-only", "a-soon", "b-only", "a-soon", "b-only"]
    assert order[6:] == ["a-late"] * 3


def test_equal_deadlines_take_turns_and_deadlines_go_before_none():
    q = FairQueue()
    for _ in range(2):
        q.push(E("a", "none"))
        q.push(E("a", "d1", deadline=100.0))
        q.push(E("a", "d2", deadline=100.0))
    assert drain(q) == ["d1", "d2", "d1", "d2", "none", "none"]


def test_a_higher_tier_still_goes_first():
    q = FairQueue()
    q.push(E("a", "normal-soon", priority=0, deadline=1.0))
    q.push(E("a", "high-late", priority=-1, deadline=9e9))
    assert drain(q) == ["high-late", "normal-soon"]
