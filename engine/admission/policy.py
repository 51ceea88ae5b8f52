"""The urgent-work and lead rules of admission, owned here and read by the host and schedulers.

Urgent work is ``priority < 0`` (the service's ``high`` tier). Three rules serve it, and this
module is their one home:

- :class:`UrgentReservation`: slots and step tokens kept for urgent work. The host sizes it
  and lets urgent requests past its in-flight cap by its slots; the engine's scheduler
  (``engine.core.scheduler``, and the simulated one) holds it and asks it which running
  sequences to preempt and whether only urgent work may be admitted this step.
- :func:`guard_urgent`: while urgent work runs, how many less urgent requests may share its
  steps (by the engine's measured step cost, ``engine.admission.step_cost``).
- :class:`LeadEpisode`: an idle engine runs a lead of a few requests alone, so a new batch's
  first results come back within a few cheap steps.

Each is pure bookkeeping: the host and the schedulers carry the decisions out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

URGENT_UPTO = -1  # the least urgent priority that counts as urgent


def is_urgent(priority: int) -> bool:
    """Urgent work: a negative priority (the ``high`` tier)."""
    return priority < 0


class Prioritised(Protocol):
    """What the rules read of a request or sequence."""

    priority: int


P = TypeVar("P", bound=Prioritised)


@dataclass(frozen=True, slots=True)
class UrgentReservation:
    """Up to ``seqs`` sequence slots and ``tokens`` of each step's budget kept for urgent work.

    The reservation is lent, not fenced off: while no urgent sequence waits, other work may
    fill every slot, so a bulk job alone keeps the engine as full as without one. When urgent
    sequences wait, a step (1) preempts the newest non-urgent running sequences (least
    computed; their full blocks stay in the prefix cache, so the recompute is mostly cache
    hits) until the urgent ones have free slots, up to the reservation (:meth:`victims`);
    (2) holds ``tokens`` back from non-urgent running sequences; (3) admits no non-urgent
    sequence before the urgent ones (:meth:`applies`). Urgent work beyond the reservation
    preempts nothing: it waits for slots that finishing sequences free, ahead of all other
    waiting work. Preempting past the reservation would buy a few steps of latency with
    recompute, and the reservation exists to bound exactly that trade.
    """

    seqs: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.seqs < 0 or self.tokens < 0:
            raise ValueError(
                f"reserved seqs and tokens must be >= 0, got {self.seqs}, {self.tokens}"
            )

    @classmethod
    def of_share(
        cls, share: float, max_num_seqs: int, max_num_batched_tokens: int
    ) -> UrgentReservation:
        """``share`` of the engine's slots and of its step's token budget, rounded up."""
        if not 0.0 <= share < 1.0:
            raise ValueError(f"reserved_share must be in [0, 1), got {share}")
        return cls(math.ceil(share * max_num_seqs), math.ceil(share * max_num_batched_tokens))

    def capped(self, max_num_seqs: int, max_num_batched_tokens: int | None) -> UrgentReservation:
        """The reservation an engine can keep: no more slots than it has, and at least one
        token of a step's budget left to the rest (``None``: a step without a token budget)."""
        tokens = self.tokens
        if max_num_batched_tokens is not None:
            tokens = min(tokens, max_num_batched_tokens - 1)
        return UrgentReservation(min(self.seqs, max_num_seqs), tokens)

    def applies(self, waiting_urgent: int) -> bool:
        """Whether this step serves urgent work first: a reservation, and urgent work waiting."""
        return self.seqs > 0 and waiting_urgent > 0

    def victims(self, running: Sequence[P], waiting_urgent: int, max_num_seqs: int) -> list[P]:
        """The running sequences to preempt (``running`` oldest first) so that waiting urgent
        work gets its reserved slots: the newest non-urgent ones, until enough slots are free."""
        if not self.applies(waiting_urgent):
            return []
        urgent_running = sum(1 for seq in running if is_urgent(seq.priority))
        want = min(waiting_urgent, self.seqs - urgent_running)
        free = max_num_seqs - len(running)
        chosen: list[P] = []
        for seq in reversed(running):
            if free >= want:
                break
            if not is_urgent(seq.priority):
                chosen.append(seq)
                free += 1
        return chosen


@dataclass(frozen=True, slots=True)
class GuardPlan(Generic[P]):
    """``suspend``: in-flight requests of less urgent tiers to suspend, newest first;
    ``room``: how many more of them may be admitted now (None: no bound); ``peak`` and
    ``allowed``: the urgent episode's peak so far and the slots less urgent work may hold
    (0 and None when no urgent work is in flight or pending)."""

    suspend: list[P] = field(default_factory=list)
    room: int | None = None
    peak: int = 0
    allowed: int | None = None


def guard_urgent(
    in_flight: Sequence[P],
    pending_urgent: int,
    room_for: Callable[[int], int],
    last: GuardPlan | None = None,
) -> GuardPlan[P]:
    """While urgent work is in flight or pending, less urgent requests may hold
    ``room_for(peak)`` slots, ``peak`` the most urgent requests in flight and pending at once
    since the episode began; within an episode those slots only grow (``last`` is the
    previous plan), so a step-cost estimate that wavers never suspends what it let in.
    ``in_flight`` oldest first."""
    urgent = sum(1 for e in in_flight if is_urgent(e.priority))
    if not urgent and not pending_urgent:
        return GuardPlan()
    peak = max(last.peak if last else 0, urgent + pending_urgent)
    allowed = room_for(peak)
    if last is not None and last.allowed is not None:
        allowed = max(allowed, last.allowed)
    lesser = [e for e in in_flight if not is_urgent(e.priority)]
    excess = len(lesser) - allowed
    return GuardPlan(lesser[::-1][: max(0, excess)], max(0, allowed - len(lesser)), peak, allowed)


class LeadEpisode:
    """``requests`` requests run alone when work reaches an idle engine, until one of them
    leaves the engine (finished, aborted or suspended) or ``steps`` steps have passed; then
    the engine fills as usual. 0 requests: no lead, the engine fills at once.

    Idle means the host's loop found nothing to do and waited (:meth:`arm`), not merely that
    nothing is in flight: a lead that finishes all at once leaves the engine empty with work
    pending, and that work must fill the engine, not start another lead of a few.

    A full first wave finishes together after the whole wave's prefill and decode (on a CPU,
    seconds to tens of seconds); a lead of a few requests runs at the cost of a few sequences
    per step, so a new batch on an idle worker shows results, or its mistakes, within
    seconds. The price is bounded: ``steps`` steps at a low occupancy per idle spell.
    """

    __slots__ = ("requests", "steps", "_ids", "_steps_left", "_on", "_armed")

    def __init__(self, requests: int, steps: int) -> None:
        if requests < 0 or steps < 1:
            raise ValueError(
                f"lead_requests must be at least 0 and lead_steps at least 1, got "
                f"{requests} and {steps}"
            )
        self.requests = requests
        self.steps = steps
        self._on = False  # an episode goes on
        self._ids: frozenset[str] = frozenset()  # the requests it admitted
        self._steps_left = 0
        self._armed = True  # a new host is idle

    def arm(self) -> None:
        """The engine went idle: the next work to arrive starts an episode."""
        self._armed = True

    def room(self, in_flight: Collection[str], has_pending: bool) -> int | None:
        """How many requests the episode lets in now (None: no episode, no bound). An episode
        starts when work reaches an idle engine (``in_flight`` empty, ``has_pending``) and
        ends once a lead request leaves ``in_flight`` or its steps run out."""
        if self._on and (
            self._steps_left <= 0
            or not self._ids
            or not all(request_id in in_flight for request_id in self._ids)
        ):
            self._on = False
        if self._on:
            return 0
        if self.requests and self._armed and not in_flight and has_pending:
            self._on, self._ids, self._steps_left = True, frozenset(), self.steps
            self._armed = False
            return self.requests
        return None

    def admitted(self, request_ids: Iterable[str]) -> None:
        """The requests admitted in the turn that started the episode are its lead."""
        if self._on and not self._ids:
            self._ids = frozenset(request_ids)

    def stepped(self) -> None:
        """One engine step passed."""
        if self._on:
            self._steps_left -= 1
