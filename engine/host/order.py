"""Who runs next: the ordering rules every place that chooses shares, written once.

The shard release window (``worker.shards.release``) and the host's fair queue (which the upstream
dispatcher uses too) apply them: tiers strictly (an integer, lowest first; :data:`NORMAL` is
``normal``, below it urgent, above it bulk); aging (:func:`aged_tier`) lifts a waiting bulk
flow one tier, never past ``NORMAL``; tenants share a tier, and a tenant's batches its share,
by tokens: the one charged the fewest goes next, among equals the one served longest ago
(:func:`share_key`); earliest deadline first among a tenant's batches of a tier, before their
token share (:func:`due`, :func:`deadline_key`). :func:`flow_key` puts them together: the
whole order, lowest first (docs/engine.md).

The places differ only in what they count as a flow's tokens: the release window keeps no
state and reads the tokens each tenant and batch holds in flight; the host's queue charges each
flow what it admits, from when the flow last became active. Pure functions; times are seconds
on the caller's clock."""

from __future__ import annotations

NORMAL = 0  # the service's ``normal`` tier; lower is more urgent, higher less
AGED_DUE = float("-inf")  # where an aged batch stands among its tenant's deadlines: first
NO_DEADLINE = float("inf")  # where a batch without a deadline stands: after every deadline
NEVER = float("-inf")  # the last service of a flow never served: longer ago than any other

Share = tuple[int, float]  # a flow's place among those it shares with (share_key)


def aged_tier(tier: int, waiting_since: float, now: float, aging_s: float | None) -> int:
    """The tier a flow of ``tier`` competes in at ``now``, having waited since
    ``waiting_since`` (its last service, or when it started waiting): one tier more urgent
    once it has waited longer than ``aging_s``, never past :data:`NORMAL` (None: no aging)."""
    if aging_s is None or tier <= NORMAL or not now - waiting_since > aging_s:
        return tier
    return tier - 1


def due(deadline: float | None, aged: bool) -> float | None:
    """A batch's place in its tenant's earliest-deadline-first order: its ``deadline`` (None:
    it has none), or before every deadline (:data:`AGED_DUE`) when it aged into its tier."""
    return AGED_DUE if aged else deadline


def deadline_key(deadline: float | None, aged: bool) -> float:
    """:func:`due` as a sort key, lowest first: a batch without a deadline after all others."""
    place = due(deadline, aged)
    return NO_DEADLINE if place is None else place


def share_key(tokens: int, last_served: float = NEVER) -> Share:
    """A flow's place among the flows it shares with (tenants in a tier, a tenant's batches in
    its share), lowest first: the fewest ``tokens`` charged to it, then the one served longest
    ago (``last_served``: :data:`NEVER` before any service). Serving the lowest and charging it
    the cost of what it got shares by tokens, whatever the sizes of the flows' requests."""
    return tokens, last_served


def flow_key(
    tier: int, tenant: Share, deadline: float | None, aged: bool, batch: Share
) -> tuple[float, ...]:
    """The order of who runs next, lowest first: the ``tier`` (as :func:`aged_tier` gives it),
    then the ``tenant``'s :func:`share_key` in the tier, then its batch's :func:`deadline_key`
    and the ``batch``'s :func:`share_key` in the tenant."""
    return (tier, *tenant, deadline_key(deadline, aged), *batch)
