"""Urgent work (``priority < 0``), as the engine core and the host both read it.

What counts as urgent, and the :class:`UrgentReservation` of slots and step tokens kept for it:
the host sizes it and lets urgent requests past its in-flight cap; the engine's schedulers hold
it and ask it what to preempt and whether only urgent work may be admitted. It lives here,
below both, so that the engine core imports nothing from the host (docs/engine.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

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
