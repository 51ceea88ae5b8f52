"""The urgent-work and lead rules of admission, owned here and read by the host.

Urgent work is ``priority < 0`` (``high``). Its reservation of slots and step tokens lives
below host and engine, in ``engine.core.urgent`` (the engine's scheduler holds it too);
:func:`guard_urgent` bounds how many less urgent requests share its steps, by the engine's
measured step cost; :class:`LeadEpisode` lets an idle engine run a few requests alone, so a
new batch's first results come back fast. Pure bookkeeping: the host and schedulers act."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from engine.core.urgent import P, is_urgent


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
