"""Shares of a full engine among tenants: who is due room, and whose requests make it.

In the most urgent tier with pending work each tenant is due an equal share of
``max_num_seqs`` (tiers are strict). A tenant below its share with work waiting gets room at
once: the newest in-flight requests of less urgent tiers, then of tenants above their share,
are suspended and wait first in their batch; one tenant alone keeps every slot. Pure:
:func:`plan_shares` says what to suspend and the host carries it out (docs/engine.md)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from engine.host.fair_queue import FairQueue


class Running(Protocol):
    """What the policy reads of an in-flight request."""

    tenant: str | None
    priority: int


R = TypeVar("R", bound=Running)


@dataclass(frozen=True, slots=True)
class SharePlan(Generic[R]):
    """``candidates``: in-flight requests to suspend, newest of the least entitled first, until
    ``need`` of them are suspended (one that cannot be is passed over); ``full``: the tenants
    that hold their share, whom admission passes over while another waits for its own."""

    candidates: list[R] = field(default_factory=list)
    need: int = 0
    full: frozenset[str | None] = frozenset()


def plan_shares(
    pending: FairQueue, in_flight: Sequence[R], *, max_num_seqs: int, free_room: int
) -> SharePlan[R]:
    """The fair-share plan for the next admission; ``in_flight`` oldest first, ``free_room``
    the slots the host's in-flight cap leaves (the engine's reserved slots are among its
    ``max_num_seqs``, lent to bulk while no urgent work waits, so the cap counts for every
    tier)."""
    tier = pending.top_tier()
    if tier is None:
        return SharePlan()
    waiting = pending.tenants_in(tier)
    running = collections.Counter(e.tenant for e in in_flight if e.priority == tier)
    active = set(waiting) | set(running)
    lesser = [e for e in in_flight if e.priority > tier]
    if len(active) < 2 and not lesser:
        return SharePlan()
    share = max(1, max_num_seqs // len(active))
    want = sum(min(n, share - running[t]) for t, n in waiting.items() if running[t] < share)
    if not want:
        return SharePlan()
    full = frozenset(t for t in active if running[t] >= share)
    need = want - max(0, free_room)
    if need <= 0:
        return SharePlan(full=full)
    over = {t: n - share for t, n in running.items() if n > share}
    candidates = lesser[::-1]
    for entry in reversed(in_flight):
        if entry.priority == tier and over.get(entry.tenant, 0) > 0:
            over[entry.tenant] -= 1
            candidates.append(entry)
    return SharePlan(candidates, need, full)
