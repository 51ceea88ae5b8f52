"""The host's queue of pending requests, released by deficit round-robin on tokens.

Strictly by priority tier, fairly across tenants, earliest deadline first across a tenant's
batches (fairly among batches without one), longest work first inside a batch (see
:class:`FairQueue`). The tier, aging and deadline rules are the ones the shard release window
applies too, from ``engine.host.order``; this module keeps the deficits and rotations.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from engine.host.order import aged_tier, due

Flow = tuple[str | None, str | None, int]


class Queued(Protocol):
    """What the queue reads of an entry: its flow (tenant, batch, priority), its batch, its
    cost in tokens; ``priority`` is lowered to the tier it was admitted from."""

    group: str | None
    cost: int
    priority: int

    @property
    def flow(self) -> Flow: ...


E = TypeVar("E", bound=Queued)


class _BatchQueue(Generic[E]):
    """One batch's pending entries (a DRR flow inside its tenant), longest work first; arrival
    order for requests without a batch."""

    __slots__ = ("key", "tier", "heap", "deficit", "in_turn", "waiting_since", "max_cost",
                 "deadline")  # fmt: skip

    def __init__(self, key: Flow, tier: int, now: float, deadline: float | None = None) -> None:
        self.key = key
        self.deadline = deadline  # the batch's deadline (unix seconds), None: none
        self.tier = tier
        self.heap: list[tuple[int, int, E]] = []
        self.deficit = 0
        self.in_turn = False
        self.waiting_since = now  # last admission, or when it started waiting
        self.max_cost = 0  # the largest request it has held since it started waiting


class _TenantQueue:
    """A tenant's batches within one tier (a DRR flow inside the tier)."""

    __slots__ = ("batches", "rotation", "deficit", "in_turn")

    def __init__(self) -> None:
        self.batches: dict[Flow, _BatchQueue] = {}
        self.rotation: collections.deque[Flow] = collections.deque()
        self.deficit = 0
        self.in_turn = False


class _Tier:
    __slots__ = ("tenants", "rotation")

    def __init__(self) -> None:
        self.tenants: dict[str | None, _TenantQueue] = {}
        self.rotation: collections.deque[str | None] = collections.deque()


class FairQueue(Generic[E]):
    """Pending requests, released by deficit round-robin on tokens. Not thread-safe: the host
    calls it under its lock.

    :meth:`pop` serves the most urgent tier (lowest ``priority``) that has work, strictly. In
    a tier, tenants take turns; each turn adds a quantum of tokens to the tenant's deficit,
    and the tenant is served while the cost of its next request fits in it. A tenant's turn
    goes to its batch with the earliest deadline (an entry's ``deadline``; batches with equal
    deadlines take turns request by request; a batch aged into a more urgent tier counts as
    due before every deadline); batches without a deadline come after those
    with one and share the turn the same way as tenants do. A batch's own order is its
    entries' ``rank`` where they carry one (lowest first: the upstream dispatcher's prefix
    clusters), else longest work first, as the engine's batch admission does (with few
    requests in the engine at a time, that order has to be applied here). The quantum is the largest request cost pending, the smallest
    that lets every turn serve at least one request (DRR's O(1) condition), so turns stay
    short: a batch that arrives joins the rotation at the back and is served after at most one
    turn of every other flow, never behind everything already queued. A flow that empties
    leaves the rotation and loses its deficit (no credit is saved up while idle).

    Aging: a batch of a tier above 0 (``low``) that has waited ``aging_s`` seconds without an
    admission moves one tier up, at most to 0 (``normal``), and stays there while it has work
    in the host, sharing that tier fairly. Urgent tiers (below 0) are never reached by aging:
    the room reserved for them is not to be taken by promoted bulk.
    """

    def __init__(
        self, aging_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.aging_s = aging_s
        self._clock = clock
        self._tiers: dict[int, _Tier] = {}
        self._batches: dict[Flow, _BatchQueue[E]] = {}
        self._promoted: dict[Flow, int] = {}
        self._per_group: collections.Counter[str] = collections.Counter()
        self._order = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def group_len(self, group: str | None) -> int:
        """Entries pending of ``group``; entries without a group are not counted."""
        return self._per_group.get(group, 0) if group is not None else 0

    @property
    def num_groups(self) -> int:
        return len(self._per_group)

    def push(self, entry: E, front: bool = False) -> None:
        """Queue ``entry`` in its batch; ``front``: ahead of the batch's other entries (a
        request suspended in flight goes back first)."""
        bq = self._batches.get(entry.flow)
        if bq is None:
            tier = self._promoted.get(entry.flow, entry.priority)
            # An aged batch goes first in its tenant (see _age).
            deadline = due(getattr(entry, "deadline", None), aged=entry.flow in self._promoted)
            bq = self._batches[entry.flow] = _BatchQueue(entry.flow, tier, self._clock(), deadline)
            self._activate(bq)
        bq.max_cost = max(bq.max_cost, entry.cost)
        rank = getattr(entry, "rank", None)
        if front:
            rank = -(1 << 62)
        elif rank is None:
            rank = -entry.cost if entry.group is not None else 0  # longest work first
        heapq.heappush(bq.heap, (rank, next(self._order), entry))
        self._count(entry, +1)

    def pop(
        self, max_priority: int | None = None, skip: frozenset[str | None] = frozenset()
    ) -> E | None:
        """The next entry to admit, or None; with ``max_priority``, only from tiers at or
        below it (the in-flight room reserved for urgent work). Tenants in ``skip`` are passed
        over in the most urgent tier (they hold their share while others wait for theirs)."""
        if self.aging_s is not None:
            self._age()
        for priority in sorted(self._tiers):
            if max_priority is not None and priority > max_priority:
                break
            return self._pop_tier(self._tiers[priority], skip)
        return None

    def top_tier(self) -> int | None:
        """The most urgent tier with pending work."""
        return min(self._tiers, default=None)

    def count_upto(self, max_priority: int) -> int:
        """Pending entries in the tiers at or below ``max_priority``."""
        return sum(
            len(bq.heap)
            for priority, tier in self._tiers.items()
            if priority <= max_priority
            for tenant in tier.tenants.values()
            for bq in tenant.batches.values()
        )

    def tenants_in(self, tier: int) -> dict[str | None, int]:
        """Pending entries per tenant in ``tier``."""
        t = self._tiers.get(tier)
        if t is None:
            return {}
        return {
            name: sum(len(bq.heap) for bq in tenant.batches.values())
            for name, tenant in t.tenants.items()
        }

    def remove(self, entries: Iterable[E]) -> None:
        by_flow: dict[Flow, set[int]] = {}
        for e in entries:
            by_flow.setdefault(e.flow, set()).add(id(e))
        for flow, gone in by_flow.items():
            bq = self._batches.get(flow)
            if bq is None:
                continue
            kept = [item for item in bq.heap if id(item[2]) not in gone]
            for item in bq.heap:
                if id(item[2]) in gone:
                    self._count(item[2], -1)
            bq.heap = kept
            heapq.heapify(kept)
            if not kept:
                self._deactivate(bq)

    def forget_group(self, group: str) -> None:
        """``group`` has nothing pending or in flight any more: drop its promotions."""
        for flow in [f for f in self._promoted if f[1] == group]:
            del self._promoted[flow]

    def clear(self) -> list[E]:
        entries = [item[2] for bq in self._batches.values() for item in bq.heap]
        self.__init__(self.aging_s, self._clock)  # type: ignore[misc]
        return entries

    # -- internals

    def _count(self, entry: E, delta: int) -> None:
        self._len += delta
        if entry.group is not None:
            self._per_group[entry.group] += delta
            if self._per_group[entry.group] <= 0:
                del self._per_group[entry.group]

    def _activate(self, bq: _BatchQueue[E]) -> None:
        tier = self._tiers.setdefault(bq.tier, _Tier())
        tenant_name = bq.key[0]
        tenant = tier.tenants.get(tenant_name)
        if tenant is None:
            tenant = tier.tenants[tenant_name] = _TenantQueue()
            tier.rotation.append(tenant_name)
        tenant.batches[bq.key] = bq
        tenant.rotation.append(bq.key)

    def _deactivate(self, bq: _BatchQueue[E], keep: bool = False) -> None:
        tier = self._tiers[bq.tier]
        tenant_name = bq.key[0]
        tenant = tier.tenants[tenant_name]
        del tenant.batches[bq.key]
        tenant.rotation.remove(bq.key)
        if not tenant.batches:
            del tier.tenants[tenant_name]
            tier.rotation.remove(tenant_name)
        if not tier.tenants:
            del self._tiers[bq.tier]
        if not keep:
            del self._batches[bq.key]

    def _age(self) -> None:
        now = self._clock()
        for bq in list(self._batches.values()):
            tier = aged_tier(bq.tier, bq.waiting_since, now, self.aging_s)
            if tier != bq.tier:
                self._deactivate(bq, keep=True)
                bq.tier = tier
                bq.deficit, bq.in_turn = 0, False
                # Aging bounds the batch's wait: an earlier deadline of its tenant's other
                # work in the tier it joins must not undo that.
                bq.deadline = due(bq.deadline, aged=True)
                bq.waiting_since = self._clock()
                if bq.key[1] is not None:
                    self._promoted[bq.key] = bq.tier
                self._activate(bq)

    def _quantum(self) -> int:
        return max(bq.max_cost for bq in self._batches.values())

    def _pop_tier(self, tier: _Tier, skip: frozenset[str | None] = frozenset()) -> E | None:
        if skip and all(name in skip for name in tier.rotation):
            return None
        while True:
            if tier.rotation[0] in skip:
                tier.rotation.rotate(-1)
                continue
            tenant = tier.tenants[tier.rotation[0]]
            if not tenant.in_turn:
                tenant.in_turn, tenant.deficit = True, tenant.deficit + self._quantum()
            earliest = _earliest_deadline(tenant)
            bq = earliest or tenant.batches[tenant.rotation[0]]
            cost = bq.heap[0][2].cost
            if tenant.deficit < cost:  # the tenant's turn is spent
                tenant.in_turn = False
                tier.rotation.rotate(-1)
                continue
            if earliest is not None:
                # Equal deadlines take turns: the one served goes behind the others.
                tenant.rotation.remove(bq.key)
                tenant.rotation.append(bq.key)
            else:
                if not bq.in_turn:
                    bq.in_turn, bq.deficit = True, bq.deficit + self._quantum()
                if bq.deficit < cost:  # this batch's part of the turn is spent
                    bq.in_turn = False
                    tenant.rotation.rotate(-1)
                    continue
                bq.deficit -= cost
            entry = heapq.heappop(bq.heap)[2]
            self._count(entry, -1)
            tenant.deficit -= cost
            bq.waiting_since = self._clock()
            entry.priority = min(entry.priority, bq.tier)  # what the engine is told
            if not bq.heap:
                self._deactivate(bq)
            return entry


def _earliest_deadline(tenant: _TenantQueue) -> _BatchQueue | None:
    """The tenant's batch with the earliest deadline (the first in its rotation among equal
    ones); None when none of its batches has a deadline."""
    best: _BatchQueue | None = None
    for key in tenant.rotation:
        bq = tenant.batches[key]
        if bq.deadline is not None and (best is None or bq.deadline < best.deadline):  # type: ignore[operator]
            best = bq
    return best
