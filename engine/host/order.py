"""Who runs next: the ordering rules that every place which chooses shares, written once.

Two places choose, each at its own scale: the shard release window (``worker.release``: which
shard of a model goes to its broker queue) and the engine host's fair queue
(``engine.host.fair_queue``: which request enters the engine; the upstream dispatcher
orders its requests with the same queue). Both apply these rules:

- tiers, strictly: a priority is an integer, the lowest runs first; :data:`NORMAL` is the
  service's ``normal``, below it is urgent (``high``), above it bulk (``low``). The service's
  names map onto these numbers in ``core.priority`` (the engine cannot import it);
- aging (:func:`aged_tier`): a flow less urgent than ``NORMAL`` that has waited longer than
  ``aging_s`` since it was last served (or since it started waiting) competes one tier more
  urgently, never past ``NORMAL``: urgent tiers are not reached by aging, the room reserved
  for them is not for promoted bulk;
- earliest deadline first among one tenant's batches of a tier (:func:`due`,
  :func:`deadline_key`): a batch aged into its tier goes before every deadline (aging bounds
  its wait, and an earlier deadline of the tenant's other work must not undo that); a batch
  without a deadline goes after every one with one;
- tenants of a tier share it by tokens, each request or shard costing its estimated tokens.
  The bookkeeping differs with the place: the host's queue keeps deficits and a rotation in
  memory (deficit round-robin); the release window keeps no state between calls (many
  processes release) and reads what each tenant holds from the database, serving the tenant
  that holds the fewest tokens, the one served longest ago among equals.

Pure functions of their arguments; times are seconds on whatever clock the caller keeps.
"""

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
