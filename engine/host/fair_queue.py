"""The host's queue of pending requests, in the order ``engine.host.order`` writes once.

Strictly by priority tier, tenants sharing a tier by tokens, earliest deadline first across a
tenant's batches (sharing its tokens among equal deadlines and among batches without one),
longest work first inside a batch (see :class:`FairQueue`). The tier, aging, deadline and
token-share rules (``flow_key``) are the ones the shard release window applies too; this module
keeps the tokens charged to each flow.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from engine.host.order import NEVER, aged_tier, flow_key, share_key

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
K = TypeVar("K")


class _Share:
    """A flow's standing in ``engine.host.order.share_key``: the tokens charged to it since it
    became active, and when it was last served (the queue's sequence; NEVER before)."""

    __slots__ = ("tokens", "served")

    def __init__(self) -> None:
        self.tokens = 0
        self.served = NEVER


F = TypeVar("F", bound=_Share)


class _Level(Generic[K, F]):
    """The flows that share one level by tokens (the tenants of a tier, a tenant's batches):
    the active ones, in the order they became active, and the standing of those that emptied
    while charged more than the least charged active one (their debt, until it catches up)."""

    __slots__ = ("flows", "owed")

    def __init__(self) -> None:
        self.flows: dict[K, F] = {}
        self.owed: dict[K, tuple[int, float]] = {}

    def join(self, key: K, flow: F) -> None:
        """``flow`` becomes active: charged as much as the least charged active flow (a flow
        saves up no credit while idle), or its debt from when it emptied where that is more
        (nor does it shed its charge by emptying)."""
        floor = min((f.tokens for f in self.flows.values()), default=0)
        tokens, served = self.owed.pop(key, (floor, NEVER))
        flow.tokens, flow.served = max(tokens, floor), served
        self.flows[key] = flow

    def leave(self, key: K) -> None:
        """The flow of ``key`` emptied; what it was charged beyond the others is kept."""
        flow = self.flows.pop(key)
        if not self.flows:
            self.owed.clear()  # nobody left to owe it to
            return
        floor = min(f.tokens for f in self.flows.values())
        if flow.tokens > floor:
            self.owed[key] = (flow.tokens, flow.served)
        for stale in [k for k, (tokens, _) in self.owed.items() if tokens <= floor]:
            del self.owed[stale]

    def forget(self, keep: Callable[[K], bool]) -> None:
        """Drop the debts of the flows ``keep`` rejects (they will not come back)."""
        for gone in [k for k in self.owed if not keep(k)]:
            del self.owed[gone]


class _BatchQueue(_Share, Generic[E]):
    """One batch's pending entries (a flow inside its tenant), longest work first; arrival
    order for requests without a batch."""

    __slots__ = ("key", "tier", "heap", "waiting_since", "deadline", "aged", "arrived")

    def __init__(
        self, key: Flow, tier: int, now: float, deadline: float | None, aged: bool, arrived: int
    ) -> None:
        super().__init__()
        self.key = key
        self.tier = tier
        self.arrived = arrived  # the queue's sequence when it started waiting: oldest first
        self.heap: list[tuple[int, int, E]] = []
        self.waiting_since = now  # last admission, or when it started waiting
        self.deadline = deadline  # the batch's deadline (unix seconds), None: none
        self.aged = aged  # aged into its tier: due before every deadline of its tenant


class _TenantQueue(_Share):
    """A tenant's batches within one tier (a flow inside the tier)."""

    __slots__ = ("batches",)

    def __init__(self) -> None:
        super().__init__()
        self.batches: _Level[Flow, _BatchQueue] = _Level()


_Tier = _Level[str | None, _TenantQueue]


class FairQueue(Generic[E]):
    """Pending requests, released in the order of ``engine.host.order.flow_key``. Not
    thread-safe: the host calls it under its lock.

    :meth:`pop` serves the most urgent tier (lowest ``priority``) that has work, strictly. In
    a tier, tenants share by tokens: the tenant charged the fewest tokens goes next, among
    equals the one served longest ago, and each admission charges its tenant and its batch the
    entry's ``cost``. A tenant's turn goes to its batch with the earliest deadline (an entry's
    ``deadline``; a batch aged into a more urgent tier counts as due before every deadline;
    batches without a deadline come after those with one); batches with equal deadlines, and
    those without one, share the tenant's turns by tokens the same way as tenants do. A
    batch's own order is its entries' ``rank`` where they carry one (lowest first: the
    upstream dispatcher's prefix clusters), else longest work first, as the engine's batch
    admission does (with few requests in the engine at a time, that order has to be applied
    here).

    A flow (a tenant in its tier, a batch in its tenant) that becomes active is charged as
    much as the least charged active flow beside it: it saves up no credit while idle, and a
    batch that arrives is served after at most one turn of every other flow, never behind
    everything already queued. A flow that empties is forgotten, unless it was charged more
    than the least charged flow still active: then it keeps that charge until the others catch
    up, so emptying and refilling gains it nothing.

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
            deadline, aged = getattr(entry, "deadline", None), entry.flow in self._promoted
            bq = self._batches[entry.flow] = _BatchQueue(
                entry.flow, tier, self._clock(), deadline, aged, next(self._order)
            )
            self._activate(bq)
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
            for tenant in tier.flows.values()
            for bq in tenant.batches.flows.values()
        )

    def tenants_in(self, tier: int) -> dict[str | None, int]:
        """Pending entries per tenant in ``tier``."""
        t = self._tiers.get(tier)
        if t is None:
            return {}
        return {
            name: sum(len(bq.heap) for bq in tenant.batches.flows.values())
            for name, tenant in t.flows.items()
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
        """``group`` has nothing pending or in flight any more: drop its promotions and what
        its batches were charged."""
        for flow in [f for f in self._promoted if f[1] == group]:
            del self._promoted[flow]
        for tier in self._tiers.values():
            for tenant in tier.flows.values():
                tenant.batches.forget(lambda flow: flow[1] != group)

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
        tier = self._tiers.get(bq.tier)
        if tier is None:
            tier = self._tiers[bq.tier] = _Level()
        tenant = tier.flows.get(bq.key[0])
        if tenant is None:
            tenant = _TenantQueue()
            tier.join(bq.key[0], tenant)
        tenant.batches.join(bq.key, bq)

    def _deactivate(self, bq: _BatchQueue[E], keep: bool = False) -> None:
        tier = self._tiers[bq.tier]
        tenant = tier.flows[bq.key[0]]
        tenant.batches.leave(bq.key)
        if not tenant.batches.flows:
            tier.leave(bq.key[0])
            if not tier.flows:
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
                # Aging bounds the batch's wait: an earlier deadline of its tenant's other
                # work in the tier it joins must not undo that.
                bq.aged = True
                bq.waiting_since = self._clock()
                if bq.key[1] is not None:
                    self._promoted[bq.key] = bq.tier
                self._activate(bq)

    def _pop_tier(self, tier: _Tier, skip: frozenset[str | None] = frozenset()) -> E | None:
        shares = {
            name: share_key(tenant.tokens, tenant.served)
            for name, tenant in tier.flows.items()
            if name not in skip
        }
        if not shares:
            return None
        # flow_key ranks tenants before their batches: only the batches of the tenants with
        # the lowest share can come first, so only theirs are ranked.
        low = min(shares.values())
        best: tuple[_TenantQueue, _BatchQueue[E]] | None = None
        best_key: tuple[float, ...] = ()
        for name, share in shares.items():
            if share != low:
                continue
            tenant = tier.flows[name]
            for bq in tenant.batches.flows.values():
                batch = share_key(bq.tokens, bq.served)
                # Among equals, the batch waiting longest (as the release window's oldest).
                key = (*flow_key(bq.tier, share, bq.deadline, bq.aged, batch), bq.arrived)
                if best is None or key < best_key:
                    best, best_key = (tenant, bq), key
        if best is None:
            return None
        tenant, bq = best
        entry = heapq.heappop(bq.heap)[2]
        self._count(entry, -1)
        tenant.tokens += entry.cost
        bq.tokens += entry.cost
        tenant.served = bq.served = next(self._order)
        bq.waiting_since = self._clock()
        entry.priority = min(entry.priority, bq.tier)  # what the engine is told
        if not bq.heap:
            self._deactivate(bq)
        return entry
