"""Who runs in the simulated engine: its running set and waiting line.

At most ``max_num_seqs`` sequences run; the rest wait as under the real scheduler's "fcfs"
admission (preempted and resumed first, then lower ``priority``, then arrival). Urgent work
preempts the newest non-urgent sequences up to the ``engine.core.urgent.UrgentReservation``, as
in the real scheduler. A resumed sequence keeps its tokens and waits the first-token latency
again; ``n > 1`` runs ``n`` sequences, and ``completion_index`` works as in the real engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.core.urgent import UrgentReservation, is_urgent
from engine.sim.requests import SimSeq


class SimScheduler:
    """Who runs: at most ``max_num_seqs`` sequences, the rest waiting in line (see the module
    docstring). Owns the running set and the waiting line; the engine owns the clock."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.running: dict[int, SimSeq] = {}  # by seq id, oldest admission first
        self.waiting = SimWaiting()
        self.reservation = UrgentReservation()  # see reserve_for_urgent
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # never: kept for the real scheduler's readers

    def reserve_for_urgent(self, reservation: UrgentReservation) -> None:
        """Keep ``reservation``'s slots for urgent work (``Scheduler.reserve_for_urgent``),
        capped to ``max_num_seqs``; a simulated step has no token budget, so its tokens go
        unused."""
        self.reservation = reservation.capped(self.max_num_seqs, None)

    def to_preempt(self) -> list[SimSeq]:
        """The newest non-urgent running sequences to preempt so that waiting urgent work gets
        its reserved slots (none when no urgent work waits)."""
        running = list(self.running.values())
        return self.reservation.victims(running, self.waiting.urgent, self.max_num_seqs)

    def admit(self) -> list[SimSeq]:
        """Take waiting sequences into the free slots, in line order; only urgent ones while
        urgent work waits. Returns them (now running)."""
        room = self.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting:
            return []
        taken = self.waiting.take(room, urgent_only=self.reservation.applies(self.waiting.urgent))
        for seq in taken:
            seq.status = "running"
            self.running[seq.seq_id] = seq
        return taken


class SimWaiting:
    """The waiting line: preempted and resumed sequences first, then by priority (lower
    first), then arrival."""

    def __init__(self) -> None:
        self.front: deque[SimSeq] = deque()
        self.by_priority: dict[int, deque[SimSeq]] = {}
        self.size = 0
        self.urgent = 0  # waiting urgent sequences

    def __len__(self) -> int:
        return self.size

    def push(self, seq: SimSeq, front: bool = False) -> None:
        if front:
            self.front.appendleft(seq)
        else:
            self.by_priority.setdefault(seq.priority, deque()).append(seq)
        self._count(seq, +1)
        seq.status = "waiting"

    def remove(self, seq: SimSeq) -> None:
        queue = self.by_priority.get(seq.priority)
        if queue is not None and seq in queue:
            queue.remove(seq)
            if not queue:
                del self.by_priority[seq.priority]
        else:
            self.front.remove(seq)
        self._count(seq, -1)

    def take(self, room: int, urgent_only: bool) -> list[SimSeq]:
        taken: list[SimSeq] = []
        for queue in self._queues():
            kept: list[SimSeq] = []
            while queue and len(taken) < room:
                seq = queue.popleft()
                if urgent_only and not is_urgent(seq.priority):
                    kept.append(seq)
                else:
                    taken.append(seq)
                    self._count(seq, -1)
            queue.extendleft(reversed(kept))
            if len(taken) >= room:
                break
        self.by_priority = {p: q for p, q in self.by_priority.items() if q}
        return taken

    def _queues(self) -> Iterator[deque[SimSeq]]:
        yield self.front
        for priority in sorted(self.by_priority):
            yield self.by_priority[priority]

    def _count(self, seq: SimSeq, delta: int) -> None:
        self.size += delta
        if is_urgent(seq.priority):
            self.urgent += delta
