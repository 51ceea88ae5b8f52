"""Iteration-level scheduling (vLLM v1 semantics): who gets each step's tokens.

Each step hands out up to ``max_num_batched_tokens`` to at most ``max_num_seqs`` sequences:
running ones first, then waiting ones in admission order. When the KV pool runs dry the newest
running sequence is preempted by recompute. Which requests reach this queue, and the slots kept
for urgent work (``engine.core.urgent.UrgentReservation``), the host decides; this scheduler
holds the reservation and carries it out. Admission order: docs/engine.md ("The scheduler").
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Generator, Iterator

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.sequence import Sequence, Status
from engine.core.urgent import UrgentReservation, is_urgent
from engine.lora.manager import LoraManager

# (priority, -expected work, sequence id, sequence, epoch at push)
HeapItem = tuple[int, int, int, Sequence, int]


class WaitingQueue:
    """Waiting sequences. Entries carry the sequence's epoch at push time; leaving the queue
    bumps the epoch, so stale entries (admitted, aborted, suspended, re-queued) are dropped
    lazily as the walks of :meth:`candidates` meet them.

    Lazily is not enough on its own: a walk stops at the first sequence that does not fit, and
    a prefix bucket is walked only while it has running members, so a stale entry may never be
    met (a bucket of a prompt that ran once holds its sequence forever). The queue therefore
    counts the entries it stores and sweeps every stale one out (:meth:`_compact`) when they
    outnumber the live ones, and drops everything at once when no sequence waits: its memory
    is bounded by the waiting sequences, at an amortised O(1) per push.
    """

    def __init__(self, policy: str, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.preempted: deque[tuple[Sequence, int]] = deque()
        self.fifo: dict[int, deque[tuple[Sequence, int]]] = {}  # priority -> arrival order
        self.heap: list[HeapItem] = []
        self.buckets: dict[object, list[HeapItem]] = {}
        self.size = 0
        self.stored = 0  # entries in the containers above, stale ones included (an upper bound)
        self._walking = 0  # candidates() walks in progress: the containers must stay put

    def __len__(self) -> int:
        return self.size

    def push(self, seq: Sequence) -> None:
        self.size += 1
        seq.epoch += 1
        if self.policy == "fcfs":
            self.fifo.setdefault(seq.priority, deque()).append((seq, seq.epoch))
            self.stored += 1
        else:
            item = (seq.priority, -seq.expected_work, seq.seq_id, seq, seq.epoch)
            heapq.heappush(self.heap, item)
            self.stored += 1
            if seq.bucket is not None:
                heapq.heappush(self.buckets.setdefault(seq.bucket, []), item)
                self.stored += 1
        self._tidy()

    def push_front(self, seq: Sequence) -> None:
        self.size += 1
        seq.epoch += 1
        self.preempted.appendleft((seq, seq.epoch))
        self.stored += 1
        self._tidy()

    def taken(self, seq: Sequence) -> None:
        """``seq`` left the queue (admitted, aborted or suspended)."""
        self.size -= 1
        seq.epoch += 1
        self._tidy()

    def _tidy(self) -> None:
        """Drop the stale entries when no sequence waits or when they outnumber the live ones
        (a live sequence has at most two entries: the heap's and its bucket's)."""
        if self._walking:
            return
        if self.size == 0:
            if self.stored:
                self.preempted.clear()
                self.fifo.clear()
                self.heap.clear()
                self.buckets.clear()
                self.stored = 0
        elif self.stored > 4 * self.size + 64:
            self._compact()

    def _compact(self) -> None:
        """Keep only live entries, in every container (O(entries))."""
        self.preempted = deque(e for e in self.preempted if _valid(*e))
        fifo = {p: deque(e for e in q if _valid(*e)) for p, q in self.fifo.items()}
        self.fifo = {p: q for p, q in fifo.items() if q}
        self.heap = [item for item in self.heap if _valid(item[3], item[4])]
        heapq.heapify(self.heap)
        buckets: dict[object, list[HeapItem]] = {}
        for item in self.heap:  # a live entry's bucket entry is the same tuple
            if item[3].bucket is not None:
                buckets.setdefault(item[3].bucket, []).append(item)
        for bucket in buckets.values():
            heapq.heapify(bucket)
        self.buckets = buckets
        self.stored = (
            len(self.preempted)
            + sum(map(len, self.fifo.values()))
            + len(self.heap)
            + sum(map(len, self.buckets.values()))
        )

    def num_urgent(self) -> int:
        """Waiting sequences with a negative (urgent) priority."""
        if self.policy == "fcfs":
            queues = [q for priority, q in self.fifo.items() if is_urgent(priority)]
            items = [(seq, epoch) for q in queues for seq, epoch in q]
        else:
            items = [(item[3], item[4]) for item in self.heap if is_urgent(item[0])]
        items += [(seq, epoch) for seq, epoch in self.preempted if is_urgent(seq.priority)]
        return sum(1 for seq, epoch in items if _valid(seq, epoch))

    def candidates(
        self, hot_buckets: dict[object, int]
    ) -> Generator[tuple[Sequence, bool], None, None]:
        """Waiting sequences in admission order, as (sequence, was_preempted)."""
        self._walking += 1
        try:
            yield from self._candidates(hot_buckets)
        finally:
            self._walking -= 1
            self._tidy()

    def _candidates(self, hot_buckets: dict[object, int]) -> Iterator[tuple[Sequence, bool]]:
        yield from _deque_iter(self.preempted, True)
        if self.policy == "fcfs":
            for priority in sorted(self.fifo):
                yield from _deque_iter(self.fifo[priority], False)
                if not self.fifo[priority]:
                    del self.fifo[priority]
            return
        # Shared-prefix buckets go first only within the most urgent waiting priority.
        while self.heap and not _valid(self.heap[0][3], self.heap[0][4]):
            heapq.heappop(self.heap)
        top = self.heap[0][0] if self.heap else 0
        for key in list(hot_buckets):
            bucket = self.buckets.get(key)
            if bucket:
                yield from _heap_iter(bucket, max_priority=top)
                if not bucket:
                    del self.buckets[key]
        yield from _heap_iter(self.heap)


def _valid(seq: Sequence, epoch: int) -> bool:
    return seq.epoch == epoch and seq.status is Status.WAITING


def _deque_iter(
    queue: deque[tuple[Sequence, int]], preempted: bool
) -> Iterator[tuple[Sequence, bool]]:
    while queue and not _valid(*queue[0]):
        queue.popleft()
    for seq, epoch in list(queue):
        if _valid(seq, epoch):
            yield seq, preempted
        while queue and not _valid(*queue[0]):
            queue.popleft()


def _heap_iter(
    heap: list[HeapItem], max_priority: int | None = None
) -> Iterator[tuple[Sequence, bool]]:
    """Walk a heap in order, dropping stale entries; entries the caller passes over stay.
    With ``max_priority``, stop at the first entry of a less urgent priority."""
    kept = []
    try:
        while heap:
            if max_priority is not None and heap[0][0] > max_priority:
                break
            item = heapq.heappop(heap)
            if not _valid(item[3], item[4]):
                continue
            kept.append(item)
            yield item[3], False
            if not _valid(item[3], item[4]):
                kept.pop()
    finally:
        for item in kept:
            heapq.heappush(heap, item)


class Scheduler:
    """``loras``: the resident adapters; a sequence holds its adapter while it runs, and one
    whose adapter cannot be made resident (every slot held) waits."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, loras: LoraManager | None = None
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.loras = loras
        self.block_size = config.block_size
        self.max_num_seqs = config.resolved_max_num_seqs
        self.waiting = WaitingQueue(config.admission, config.block_size)
        self.running: list[Sequence] = []
        self.hot_buckets: dict[object, int] = {}  # bucket -> number of running members
        self.num_preemptions = 0
        self.num_chunked_prefills = 0
        self.reservation = UrgentReservation()  # see reserve_for_urgent
        self.urgent_waiting = False
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0

    def add(self, seq: Sequence) -> None:
        if len(seq) > self.block_size:
            seq.bucket = seq.hashes_for(1, self.block_size)[0]
        seq.status = Status.WAITING
        self.waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence joins the running set directly (its blocks are already shared)."""
        self._hold_lora(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._hot(seq, +1)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's (sequence, number of tokens to compute) pairs."""
        budget = self.config.max_num_batched_tokens
        bm = self.bm
        running = self.running
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        held = self._make_room_for_urgent()
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            remaining = len(seq) - seq.num_computed_tokens
            n = min(remaining, budget if is_urgent(seq.priority) else budget - held)
            if n <= 0:  # the rest of the budget is held for waiting urgent work
                i += 1
                continue
            while not bm.grow(seq, seq.num_computed_tokens + n):
                victim = running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if n < remaining:
                    self.num_chunked_prefills += 1
                scheduled.append((seq, n))
                budget -= n
                i += 1
        if preempted or budget == 0 or len(running) >= self.max_num_seqs:
            return scheduled
        self._admit(scheduled, budget)
        return scheduled

    def _admit(self, scheduled: list[tuple[Sequence, int]], budget: int) -> None:
        bm, bs = self.bm, self.block_size
        caching = bm.enable_prefix_caching
        pending: set[bytes] = set()
        if caching:
            for seq in self.running:
                if seq.num_computed_tokens < len(seq) - 1:
                    pending.update(
                        seq.hashes_for(len(seq) // bs, bs)[seq.num_computed_tokens // bs :]
                    )
        candidates = self.waiting.candidates(self.hot_buckets)
        try:
            for seq, was_preempted in candidates:
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if self.urgent_waiting and not is_urgent(seq.priority):
                    continue  # urgent work first, preempted bulk included
                cached = bm.match_prefix(seq)
                nxt = len(cached)
                if (
                    caching
                    and not was_preempted
                    and (nxt + 1) * bs < len(seq)
                    and seq.hashes_for(nxt + 1, bs)[nxt] in pending
                ):
                    if self.config.admission == "fcfs":
                        break
                    continue  # wait a step: that block is being computed right now
                num_cached = nxt * bs
                remaining = len(seq) - num_cached
                n = min(remaining, budget)
                lora = seq.request.lora
                if lora is not None and not self._can_hold_lora(lora):
                    continue  # every adapter slot is held by running sequences: it waits
                if not bm.allocate(seq, cached, num_cached + n):
                    break
                self._hold_lora(seq)
                self.waiting.taken(seq)
                seq.status = Status.RUNNING
                seq.num_computed_tokens = num_cached
                self._count_prompt(seq, num_cached)
                if n < remaining:
                    self.num_chunked_prefills += 1
                self.running.append(seq)
                self._hot(seq, +1)
                scheduled.append((seq, n))
                budget -= n
                if caching:
                    pending.update(seq.hashes_for(len(seq) // bs, bs)[nxt:])
        finally:
            candidates.close()

    def _count_prompt(self, seq: Sequence, num_cached: int) -> None:
        """Count a request's prompt and its cache hit once, at its first admission: a preempted
        sequence that is admitted again, or a completion of an ``n > 1`` request, would count
        the same prompt twice and inflate the hit rate."""
        request = seq.request
        if request.admitted:
            return
        request.admitted = True
        self.total_prompt_tokens += len(request.prompt_token_ids)
        self.total_cached_tokens += num_cached
        request.metrics.num_cached_tokens = num_cached

    def reserve_for_urgent(self, reservation: UrgentReservation) -> None:
        """Keep ``reservation``'s sequence slots and tokens of each step's budget for urgent
        work, capped to what this engine has: the rule, lent while no urgent work waits, is
        ``engine.core.urgent.UrgentReservation``; this scheduler carries it out."""
        self.reservation = reservation.capped(self.max_num_seqs, self.config.max_num_batched_tokens)

    def _make_room_for_urgent(self) -> int:
        """Apply the reservation for this step: preempt the sequences it names, and return
        the tokens to hold back from non-urgent running sequences."""
        self.urgent_waiting = False
        reservation = self.reservation
        if not reservation.seqs:
            return 0
        waiting = self.waiting.num_urgent()
        if not reservation.applies(waiting):
            return 0
        self.urgent_waiting = True
        for victim in reservation.victims(self.running, waiting, self.max_num_seqs):
            self.preempt(victim)
        return reservation.tokens

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._hot(seq, -1)
        self._drop_lora(seq)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def suspend(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running set or the waiting queue, freeing its blocks (full
        ones stay in the prefix cache); :meth:`resume` brings it back."""
        self._release(seq, Status.SUSPENDED)
        seq.num_computed_tokens = 0

    def resume(self, seq: Sequence) -> None:
        """A suspended sequence waits again, first in line, like a preempted one: it recomputes
        its tokens (mostly prefix-cache hits) and goes on generating."""
        seq.status = Status.WAITING
        self.waiting.push_front(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        self._release(seq, Status.FINISHED)

    def _release(self, seq: Sequence, status: Status) -> None:
        """Out of the running set or the waiting queue, its blocks freed, now ``status``."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._hot(seq, -1)
            self._drop_lora(seq)
        elif seq.status is Status.WAITING:
            self.waiting.taken(seq)
        self.bm.free_seq(seq)
        seq.status = status

    def _can_hold_lora(self, name: str) -> bool:
        return self.loras is not None and self.loras.can_acquire(name)

    def _hold_lora(self, seq: Sequence) -> None:
        name = seq.request.lora
        if name is not None:
            assert self.loras is not None
            held = self.loras.acquire(name)
            assert held, "checked by _can_hold_lora, or held by the parent of a fork"

    def _drop_lora(self, seq: Sequence) -> None:
        name = seq.request.lora
        if name is not None and self.loras is not None:
            self.loras.release(name)

    def _hot(self, seq: Sequence, delta: int) -> None:
        key = seq.bucket
        if key is None:
            return
        count = self.hot_buckets.get(key, 0) + delta
        if count > 0:
            self.hot_buckets[key] = count
        else:
            self.hot_buckets.pop(key, None)
