"""Tenants and batches share the host's queue by tokens (engine.host.fair_queue, with the rule of
engine.host.order.share_key): the one charged the fewest goes next, a flow that arrives joins
level with the others, and neither idling nor emptying and refilling changes a flow's share."""

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
    def flow(self) -> tuple[str, str, int]:
        return self.tenant, self.group, self.priority


def pops(q: FairQueue, n: int | None = None) -> list[str]:
    out = []
    while (n is None or len(out) < n) and (e := q.pop()) is not None:
        out.append(e.group)
    return out


def test_tenants_share_a_tier_by_tokens_whatever_their_request_sizes() -> None:
    q: FairQueue = FairQueue()
    for _ in range(10):
        q.push(E("a", "a1", cost=100))
        q.push(E("b", "b1", cost=300))
    # As the release window orders shards of the same costs (tests/worker/shards/test_release.py).
    assert pops(q, 8) == ["a1", "b1", "a1", "a1", "b1", "a1", "a1", "a1"]


def test_a_flow_that_arrives_is_served_next_not_behind_the_queue_nor_ahead_of_it() -> None:
    q: FairQueue = FairQueue()
    for _ in range(20):
        q.push(E("a", "bulk"))
    assert pops(q, 10) == ["bulk"] * 10
    for _ in range(3):
        q.push(E("b", "small"))
    # b saved up no credit while it had nothing queued: it alternates with a, from now on.
    assert pops(q, 6) == ["small", "bulk"] * 3
    # The same for a batch inside its tenant.
    for _ in range(3):
        q.push(E("a", "other"))
    assert pops(q, 6) == ["other", "bulk"] * 3


def test_emptying_and_refilling_gains_a_flow_nothing() -> None:
    """Tenant b keeps one large request queued at a time (its producer refills it after each
    admission); a keeps many small ones. They still share by tokens, not by requests."""
    q: FairQueue = FairQueue()
    for _ in range(200):
        q.push(E("a", "small", cost=10))
    q.push(E("b", "large", cost=100))
    tokens = {"a": 0, "b": 0}
    for _ in range(110):
        e = q.pop()
        tokens[e.tenant] += e.cost
        if e.tenant == "b":
            q.push(E("b", "large", cost=100))
    assert abs(tokens["a"] - tokens["b"]) <= 100, tokens


def test_tenants_passed_over_are_not_served_and_not_charged() -> None:
    q: FairQueue = FairQueue()
    for _ in range(3):
        q.push(E("a", "a1"))
        q.push(E("b", "b1"))
    assert pops(q, 2) == ["a1", "b1"]
    assert q.pop(skip=frozenset({"a"})).group == "b1"
    assert q.pop(skip=frozenset({"a", "b"})) is None
    # a was charged nothing for it: a (10) goes first, then b, served longest ago at 20 each.
    assert pops(q) == ["a1", "b1", "a1"]


def test_an_aged_batch_goes_first_in_its_tenant_and_shares_the_tier() -> None:
    now = [0.0]
    q: FairQueue = FairQueue(aging_s=5.0, clock=lambda: now[0])
    for _ in range(2):
        q.push(E("a", "bulk", priority=1, deadline=9e9))
        q.push(E("a", "soon", deadline=1.0))
        q.push(E("b", "b1"))
    assert pops(q, 2) == ["soon", "b1"]
    now[0] = 6.0  # bulk waited longer than the bound: it joins normal, due before "soon"
    assert pops(q) == ["bulk", "b1", "bulk", "soon"]
