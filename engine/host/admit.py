"""Between two engine steps, the one decision of who enters the engine next.

:class:`Admission` owns the host's pending requests (a :class:`FairQueue`) and applies, in
order, the tenants' shares of a full engine (``fair_share``), the urgent guard and reservation
(``policy``, ``engine.core.urgent``), an idle engine's lead, then the queue's own order; the host
carries it out under its lock. Invariants: past the in-flight cap only urgent work enters, at
most ``reserved_seqs`` of it; while the urgent guard is full only urgent work enters; a request
suspended for a share or for urgent work waits first in its batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.core.urgent import URGENT_UPTO, UrgentReservation, is_urgent
from engine.host.entry import IN_FLIGHT, Entry
from engine.host.fair_queue import FairQueue
from engine.host.fair_share import plan_shares
from engine.host.policy import GuardPlan, LeadEpisode, guard_urgent

Suspend = Callable[[Entry], bool]  # suspend one in-flight entry in the engine; False if it cannot


class Admission:
    """The pending requests and the rules that choose among them; loop thread, host's lock."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_pending: int,
        group_window: int,
        max_in_flight: int,
        reservation: UrgentReservation,
        fair_share: bool,
        urgent_slowdown: float | None,
        aging_s: float | None,
        lead: LeadEpisode,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if group_window < 1:
            raise ValueError(f"group_window must be at least 1, got {group_window}")
        if urgent_slowdown is not None and not urgent_slowdown >= 1.0:
            raise ValueError(
                f"urgent_slowdown must be at least 1 (or None for no guard), got {urgent_slowdown}"
            )
        if aging_s is not None and aging_s <= 0:
            raise ValueError(f"aging_s must be positive (or None for no aging), got {aging_s}")
        self.pending: FairQueue[Entry] = FairQueue(aging_s)
        self.max_pending = max_pending
        self.group_window = group_window
        self.max_num_seqs = max_num_seqs
        self.max_in_flight = max_in_flight
        # Urgent work may exceed the in-flight cap by the reserved number of sequences.
        self.reserved_seqs = reservation.seqs
        self.fair_share = fair_share
        self.urgent_slowdown = urgent_slowdown
        self.lead = lead
        self._guard: GuardPlan | None = None  # the urgent episode's last plan (guard_urgent)

    def bound(self, group: str | None) -> tuple[int, int]:
        """(pending requests, the most it may hold) for ``group``: a batch may hold
        ``group_window`` pending requests and at most an even share of ``max_pending`` among
        the batches that have some; one with none pending always gets in. Requests without a
        group share ``max_pending``."""
        pending = self.pending
        if group is None:
            return len(pending), self.max_pending
        held = pending.group_len(group)
        if held == 0:
            return 0, 1
        share = self.max_pending // pending.num_groups
        return held, max(1, min(self.group_window, share))

    def idle(self) -> None:
        """Nothing pending or in flight: no urgent episode goes on, and the next work to come
        starts a lead episode."""
        self._guard = None
        self.lead.arm()

    def choose(
        self,
        in_flight: dict[str, Entry],
        step_cost: Any,
        suspend: Suspend,
        claim: Callable[[Entry], bool],
        forget: Callable[[Entry], None],
    ) -> list[Entry]:
        """The pending entries to admit now, marked in flight, most due first. ``step_cost``
        is the engine's step-cost curve (None: no guard); ``claim(entry)`` is False for an
        entry its caller cancelled, which is ``forget``-ten instead."""
        pending = self.pending
        skip = self._share_out(in_flight, suspend) if pending else frozenset()
        lesser_room = self._guard_urgent(in_flight, step_cost, suspend)
        room = self.max_in_flight - len(in_flight)
        lead_room = self.lead.room(in_flight, bool(pending))
        if lead_room is not None:
            room = min(room, lead_room)
        admitted: list[Entry] = []
        while room + self.reserved_seqs > 0 and pending:
            # Past the cap, only urgent work enters (the reserved room), and only urgent work
            # while the guard's room for the rest is used.
            urgent_only = room <= 0 or lesser_room == 0
            entry = pending.pop(URGENT_UPTO if urgent_only else None, skip)
            if entry is None:
                break
            if entry.suspended is None and not claim(entry):
                forget(entry)  # the caller cancelled it while pending
                continue
            entry.state = IN_FLIGHT
            admitted.append(entry)
            room -= 1
            if lesser_room is not None and not is_urgent(entry.priority):
                lesser_room -= 1
        self.lead.admitted(e.request_id for e in admitted)
        return admitted

    def _share_out(self, in_flight: dict[str, Entry], suspend: Suspend) -> frozenset[str | None]:
        """Carry out the fair-share plan; returns the tenants that hold their share."""
        if not self.fair_share:
            return frozenset()
        plan = plan_shares(
            self.pending,
            list(in_flight.values()),
            max_num_seqs=self.max_num_seqs,
            free_room=self.max_in_flight - len(in_flight),
        )
        need = plan.need
        for entry in plan.candidates:
            if need == 0:
                break
            if suspend(entry):
                need -= 1
        return plan.full

    def _guard_urgent(
        self, in_flight: dict[str, Entry], curve: Any, suspend: Suspend
    ) -> int | None:
        """Carry out the urgent guard; returns how many less urgent requests may still be
        admitted (None: any)."""
        if self.urgent_slowdown is None or curve is None:
            return None
        slowdown, seqs = self.urgent_slowdown, self.max_num_seqs

        def room_for(peak: int) -> int:
            return curve.room(peak, slowdown, max(0, seqs - peak))

        plan = guard_urgent(
            list(in_flight.values()), self.pending.count_upto(URGENT_UPTO), room_for, self._guard
        )
        for entry in plan.suspend:
            suspend(entry)
        self._guard = replace(plan, suspend=[])  # the episode's bounds; no entries held
        return plan.room
