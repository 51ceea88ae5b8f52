"""Who runs next: the ordering rules every place that chooses shares, written once.

The shard release window (``worker.shards.release``) and the host's fair queue (which the upstream
dispatcher uses too) apply them: tiers strictly (an integer, lowest first; :data:`NORMAL` is
``normal``, below it urgent, above it bulk); aging (:func:`aged_tier`) lifts a waiting bulk
flow one tier, never past ``NORMAL``; earliest deadline first among a tenant's batches of a
tier (:func:`due`, :func:`deadline_key`); tenants share a tier by tokens (docs/engine.md).
Pure functions; times are seconds on the caller's clock."""

from __future__ import annotations

NORMAL = 0  # the service's ``normal`` tier; lower is more urgent, higher less
AGED_DUE = float("-inf")  # where an aged batch stands among its tenant's deadlines: first
NO_DEADLINE = float("inf")  # where a batch without a deadline stands: after every deadline


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
