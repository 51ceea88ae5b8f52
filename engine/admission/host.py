"""A thread-safe host that keeps one engine saturated while many producers feed it.

The worker runs several shard threads per process, all sharing one model on one device. The
engine itself is single-threaded: only the host's loop thread ever touches it. Producers call
:meth:`EngineHost.submit` from any thread and get a :class:`concurrent.futures.Future`;
submissions, aborts and stats requests travel to the loop through a lock-protected queue, and
the loop applies them between two engine steps.

Who runs next is decided here, not in the engine's waiting queue. Pending requests wait in a
:class:`FairQueue`: one queue per batch (``group``), grouped by ``tenant`` and priority tier,
served by deficit round-robin on tokens (prompt + ``max_tokens``): tiers strictly (lower
``priority`` first; an aging bound lifts a starved ``low`` batch to ``normal``), tenants
fairly in a tier, a tenant's batches fairly in its share, longest work first in a batch. The
loop refills the engine's free slots between two steps and hands it no backlog by default
(``engine_backlog=0``): anything parked in the engine's own queue would be ordered by
priority and length across batches, and a newly arriving batch would queue behind it.

Shares of a full engine (``engine.admission.fair_share``): a tenant or tier that arrives while others
hold every slot gets its share at once; the newest requests of less urgent tiers, then of
tenants above their share, are suspended (``Engine.suspend_request``: KV freed, output kept)
and resume first in their batch (``fair_share=False`` turns this off).

An ``n > 1`` request is split into ``n`` single completions (``engine.admission.entry.split``),
each an entry of its own in the queue, the shares and the in-flight cap, suspended like any
other: it holds ``n`` slots, not one, and one tenant's ``n = 128`` lines cannot take the
engine from the others (as one engine request it would hold a slot while its completions,
forked inside the engine, filled every other one and queued ahead of everyone). The engine
runs completion ``i`` with ``completion_index=i``, which gives the tokens the unsplit request
gives it (with prefix caching, completions admitted together compute the prompt once and
read its full blocks from the cache); the caller's future resolves once, with all ``n``
completions. The stats' counters count requests; ``pending`` and ``in_flight`` count
completions.

Memory stays bounded: a batch may hold at most ``group_window`` pending requests (default
``max_num_seqs``, enough to refill every slot of the engine at once, so a batch alone keeps it
full) and at most its even share of ``max_pending``; ``submit`` blocks, optionally with a
timeout, while its batch is at that bound. A batch with nothing pending is always let in, so
a newcomer never waits for a bulk batch's queue to drain. Requests without a group share the
whole ``max_pending`` bound.

``reserved_share`` keeps a share of ``max_num_seqs`` and of the step's token budget for urgent
work (``priority < 0``, the ``high`` tier): the host lets urgent requests past its in-flight
cap by that many, and the engine's scheduler makes room for them (see
``Scheduler.reserve_for_urgent``).

``urgent_slowdown`` bounds what bulk costs urgent work on hardware where a step's cost grows
with its sequences: while urgent requests are in flight or pending, less urgent ones may hold
only as many slots as keep a step within that factor of its cost without them, by the
engine's measured step-cost curve (``engine.admission.step_cost``; the newest beyond it are suspended
and resume when the urgent work is done). On an accelerator the curve is flat and nothing is
held back; on a CPU it is a handful of slots. None (the default) turns the guard off.

``lead_requests`` gets an idle engine's first results back fast. When work reaches an engine
with nothing in flight, only that many requests are admitted, and nothing else joins them
(urgent work aside) until one of them finishes or ``lead_steps`` steps have passed; then the
engine fills as usual. A full first wave finishes together after the whole wave's prefill and
decode (on a CPU, seconds to tens of seconds); a lead of a few requests runs at the cost of a
few sequences per step, so a new batch on an idle worker shows results, or its mistakes,
within seconds. The price is bounded: ``lead_steps`` steps at a low occupancy per idle spell.
0 (the default here; the worker sets it) admits at once.

Aborted requests (``abort``, ``abort_group``, ``shutdown(abort_pending=True)``) never leave a
future cancelled: every future resolves with a :class:`RequestOutput` whose completions carry
``finish_reason == "abort"``. A request aborted before it reached the engine has empty
completions; one aborted in flight carries what the engine reports for it (or empty
completions when the engine reports nothing). A caller may still ``Future.cancel()`` a request
that the loop has not admitted yet; the loop then skips it.

A failure inside ``Engine.step()`` fails the futures of every request in flight with
:class:`EngineStepError` (its ``__cause__`` is the original exception), aborts them in the
engine so their KV blocks return, logs the traceback, and the host keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from engine.admission.entry import (
    IN_FLIGHT,
    PENDING,
    Entry,
    Fanout,
    abort_output,
    expected_tokens,
    fail,
    resolve,
    resolve_call,
    split,
)
from engine.admission.fair_queue import FairQueue
from engine.admission.fair_share import GuardPlan, guard_urgent, plan_shares
from engine.core.engine import Engine
from engine.core.outputs import HostStats, RequestOutput
from engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class HostError(RuntimeError):
    """The host cannot take the request: it is shut down, or its loop died."""


class HostQueueFull(TimeoutError):
    """``submit`` waited ``timeout`` seconds and the host's queue stayed full."""


class EngineStepError(RuntimeError):
    """``Engine.step()`` raised while this request was in flight; ``__cause__`` says why."""


@dataclass(slots=True)
class _Counters:
    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    step_errors: int = 0
    steps: int = 0
    suspended: int = 0  # in-flight requests suspended for another tenant's share or urgent work
    base_steps: int | None = None  # engine counters when the host started, for its own means
    base_running_seq_steps: int = 0


@dataclass(slots=True)
class _Lead:
    """A lead episode (``lead_requests``): the requests it admitted and the steps it has left."""

    ids: frozenset[str] = frozenset()
    steps_left: int = 0


@dataclass(slots=True)
class _StatsRequest:
    future: Future = field(default_factory=Future)


class EngineHost:
    """Own one :class:`Engine` on a background thread; accept work from any thread.

    ``EngineHost(engine)`` wraps an engine built by the caller (it must not be used by anyone
    else afterwards).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_pending: int | None = None,
        engine_backlog: int | None = None,
        group_window: int | None = None,
        reserved_share: float = 0.0,
        urgent_slowdown: float | None = None,
        aging_s: float | None = None,
        fair_share: bool = True,
        lead_requests: int = 0,
        lead_steps: int = 64,
        name: str = "engine-host",
    ) -> None:
        config = engine.config
        max_num_seqs = int(config.max_num_seqs)
        if max_pending is None:
            max_pending = 2 * max_num_seqs
        if engine_backlog is None:
            engine_backlog = 0
        if group_window is None:
            group_window = max_num_seqs
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if engine_backlog < 0:
            raise ValueError(f"engine_backlog must be at least 0, got {engine_backlog}")
        if group_window < 1:
            raise ValueError(f"group_window must be at least 1, got {group_window}")
        if not 0.0 <= reserved_share < 1.0:
            raise ValueError(f"reserved_share must be in [0, 1), got {reserved_share}")
        if urgent_slowdown is not None and not urgent_slowdown >= 1.0:
            raise ValueError(
                f"urgent_slowdown must be at least 1 (or None for no guard), got {urgent_slowdown}"
            )
        if aging_s is not None and aging_s <= 0:
            raise ValueError(f"aging_s must be positive (or None for no aging), got {aging_s}")
        if lead_requests < 0 or lead_steps < 1:
            raise ValueError(
                f"lead_requests must be at least 0 and lead_steps at least 1, got "
                f"{lead_requests} and {lead_steps}"
            )
        self._engine = engine
        self._max_num_seqs = max_num_seqs
        self.fair_share = fair_share
        self.urgent_slowdown = urgent_slowdown
        self._guard: GuardPlan | None = None  # the urgent episode's last plan (guard_urgent)
        self.lead_requests = lead_requests
        self.lead_steps = lead_steps
        self._lead: _Lead | None = None  # the lead episode going on (loop thread only)
        self.max_pending = max_pending
        self.group_window = group_window
        self.max_in_flight = max_num_seqs + engine_backlog
        # Urgent work may exceed the in-flight cap by the reserved number of sequences.
        self.reserved_seqs = math.ceil(reserved_share * max_num_seqs)
        reserved_tokens = math.ceil(reserved_share * int(config.max_num_batched_tokens))
        reserve = getattr(getattr(engine, "scheduler", None), "reserve_for_urgent", None)
        if reserve is not None:
            reserve(self.reserved_seqs, reserved_tokens)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the loop waits here when idle
        self._space = threading.Condition(self._lock)  # producers wait here while full
        self._pending = FairQueue(aging_s)
        self._live: dict[str, Entry] = {}  # pending and in flight, by request id
        self._fanouts: dict[str, Fanout] = {}  # split n > 1 requests, by the caller's id
        self._groups: dict[str, set[str]] = {}
        self._to_abort: list[Entry] = []  # in-flight entries the loop must abort in the engine
        self._stats_requests: list[_StatsRequest] = []
        self._num_in_flight = 0
        self._closing = False
        self._drain = True
        self._dead: BaseException | None = None
        self._counters = _Counters()
        # Request ids unique to this host (a random prefix, then a counter): no urandom call,
        # and so no release of the GIL, per request.
        self._request_ids = map(f"{secrets.token_hex(6)}-{{}}".format, itertools.count())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def engine(self) -> Engine:
        """The engine, for reading its config or tokenizer; never call its methods directly."""
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    def start(self) -> EngineHost:
        with self._lock:
            if self._started:
                return self
            if self._closing:
                raise HostError("cannot start a host that was shut down")
            self._started = True
        self._thread.start()
        return self

    def shutdown(
        self, wait: bool = True, *, abort_pending: bool = False, timeout: float | None = None
    ) -> None:
        """Stop taking work. By default the loop finishes everything already submitted and then
        exits; with ``abort_pending`` every pending and in-flight request is aborted instead
        (as are requests queued on a host that was never started). Producers blocked in
        ``submit`` get :class:`HostError`."""
        with self._lock:
            self._closing = True
            if abort_pending:
                self._drain = False
            self._space.notify_all()
            self._work.notify_all()
            started = self._started
        if abort_pending or not started:
            self._abort_where(lambda e: True)
        if wait and started and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> EngineHost:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.shutdown(wait=True, abort_pending=exc_type is not None)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ producers

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        group: str | None = None,
        request_id: str | None = None,
        callback: Callable[[Future], None] | None = None,
        timeout: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        deadline: float | None = None,
    ) -> Future:
        """Queue one request; block while its batch (``group``) holds its share of the host's
        queue (see the module docstring).

        ``priority`` is the request's tier: lower first (vLLM's convention), strictly, but for
        aging. ``tenant`` and ``group`` (the batch) make the flows that share a tier fairly.
        ``cache_salt`` scopes the prefix cache (see ``Engine.add_request``). ``deadline`` (unix
        seconds, the batch's) orders a tenant's batches in a tier: earliest deadline first.

        Returns a future that resolves with the request's :class:`RequestOutput` (also for an
        abort), or raises ``RequestError`` (the engine refused it) or :class:`EngineStepError`.
        ``callback(future)`` runs when it resolves, on whichever thread resolves it (usually
        the loop thread): keep it short. ``timeout`` bounds the wait for queue space and
        raises :class:`HostQueueFull`.
        """
        params = params if params is not None else SamplingParams()
        prompt = list(prompt_token_ids)
        entry = Entry(
            request_id=request_id if request_id is not None else next(self._request_ids),
            prompt_token_ids=prompt,
            params=params,
            group=group,
            future=Future(),
            arrival_time=time.time(),
            priority=int(priority),
            cache_salt=cache_salt,
            tenant=tenant,
            cost=expected_tokens(prompt, params),
            deadline=deadline,
        )
        fanout, entries = split(entry) if params.n > 1 else (None, [entry])
        if callback is not None:
            entry.future.add_done_callback(callback)
        if fanout is not None:
            for e in entries:
                e.future.add_done_callback(partial(self._settle, fanout, e.index))
            entry.future.add_done_callback(partial(self._on_cancel, entry.request_id))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                self._check_open()
                held, limit = self._bound(group)
                if held < limit:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if threading.current_thread() is self._thread:
                    remaining = 0.0  # a callback on the loop thread must not wait for itself
                if remaining is not None and remaining <= 0:
                    whose = "" if group is None else f" of group {group!r}"
                    raise HostQueueFull(
                        f"engine host queue is full: {held} pending requests{whose} (limit "
                        f"{limit}; max_pending={self.max_pending}, group_window="
                        f"{self.group_window}) after waiting {timeout or 0:g}s"
                    )
                self._space.wait(remaining)
            taken = [e.request_id for e in entries if e.request_id in self._live]
            if entry.request_id in self._live or entry.request_id in self._fanouts or taken:
                raise ValueError(
                    f"request id {(taken or [entry.request_id])[0]!r} is already pending or in flight"
                )
            if fanout is not None:
                self._fanouts[entry.request_id] = fanout
            for e in entries:
                self._live[e.request_id] = e
                if group is not None:
                    self._groups.setdefault(group, set()).add(e.request_id)
                self._pending.push(e)
            self._counters.submitted += 1
            self._work.notify()
        return entry.future

    def _bound(self, group: str | None) -> tuple[int, int]:
        """(pending requests, the most it may hold) for ``group``; the caller holds the lock.
        A batch may hold ``group_window`` pending requests and at most an even share of
        ``max_pending`` among the batches that have some; one with none pending always gets
        in. Requests without a group share ``max_pending``."""
        pending = self._pending
        if group is None:
            return len(pending), self.max_pending
        held = pending.group_len(group)
        if held == 0:
            return 0, 1
        share = self.max_pending // pending.num_groups
        return held, max(1, min(self.group_window, share))

    def abort(self, request_id: str) -> bool:
        """Abort one pending or in-flight request; False if it is unknown or already done."""
        with self._lock:
            fanout = self._fanouts.get(request_id)
        if fanout is not None:
            members = fanout.member_ids()
            return self._abort_where(lambda e: e.fanout is fanout, ids=members) > 0
        return (
            self._abort_where(
                lambda e: e.request_id == request_id and e.fanout is None, ids=[request_id]
            )
            > 0
        )

    def abort_group(self, group: str) -> int:
        """Abort every pending and in-flight request of ``group`` at once.

        Pending ones resolve immediately; in-flight ones are aborted by the loop before its
        next step (their KV blocks are freed) and resolve then. Returns how many requests were
        pending or in flight when called (one finishing in the current step still counts).
        """
        with self._lock:
            ids = list(self._groups.get(group, ()))
        return self._abort_where(lambda e: e.group == group, ids=ids)

    def stats(self, timeout: float | None = 30.0) -> HostStats:
        """A snapshot taken by the loop between two steps (or directly when it is not running)."""
        if threading.current_thread() is self._thread:
            return self._snapshot()
        with self._lock:
            loop_running = self._thread.is_alive() and self._dead is None
            if loop_running:
                request = _StatsRequest()
                self._stats_requests.append(request)
                self._work.notify()
        if loop_running:
            return request.future.result(timeout)
        return self._snapshot()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._dead is not None:
            raise HostError("engine host loop died") from self._dead
        if self._closing:
            raise HostError("engine host is shut down")

    def _abort_where(self, match: Callable[[Entry], bool], ids: Iterable[str] | None = None) -> int:
        """Abort the live entries that ``match`` (among ``ids``); returns how many requests
        they are (the completions of a split request count as one)."""
        with self._lock:
            candidates = (
                [self._live[i] for i in ids if i in self._live]
                if ids is not None
                else list(self._live.values())
            )
            entries = [e for e in candidates if match(e) and not e.abort_requested]
            pending = [e for e in entries if e.state == PENDING]
            in_flight = [e for e in entries if e.state == IN_FLIGHT]
            if pending:
                self._pending.remove(pending)
                for e in pending:
                    self._forget(e)
                self._counters.aborted += _requests(pending)
                self._space.notify_all()
            for e in in_flight:
                e.abort_requested = True
            if in_flight:
                self._to_abort.extend(in_flight)
                self._work.notify()
        for e in pending:
            resolve(e.future, abort_output(e))
        return len({id(e.fanout or e) for e in entries})

    def _forget(self, entry: Entry) -> None:
        """Drop an entry from the indexes; the caller holds the lock."""
        if self._live.pop(entry.request_id, None) is not None and entry.fanout is not None:
            entry.fanout.live -= 1
            if entry.fanout.live == 0:
                self._fanouts.pop(entry.fanout.request_id, None)
        if entry.group is not None:
            members = self._groups.get(entry.group)
            if members is not None:
                members.discard(entry.request_id)
                if not members:
                    del self._groups[entry.group]
                    self._pending.forget_group(entry.group)

    def _snapshot(self) -> HostStats:
        engine_stats = self._engine.stats()
        c = self._counters
        occupancy = 0.0
        if c.base_steps is not None and self._max_num_seqs > 0:
            steps = engine_stats.num_steps - c.base_steps
            seq_steps = engine_stats.total_running_seq_steps - c.base_running_seq_steps
            if steps > 0:
                occupancy = seq_steps / steps / self._max_num_seqs
        with self._lock:
            pending = len(self._pending)
        return HostStats(
            engine=engine_stats,
            pending=pending,
            in_flight=self._num_in_flight,
            submitted=c.submitted,
            completed=c.completed,
            aborted=c.aborted,
            failed=c.failed,
            step_errors=c.step_errors,
            steps=c.steps,
            suspended=c.suspended,
            mean_occupancy=occupancy,
            max_pending=self.max_pending,
            max_in_flight=self.max_in_flight,
        )

    def _run(self) -> None:
        try:
            base = self._engine.stats()
            self._counters.base_steps = base.num_steps
            self._counters.base_running_seq_steps = base.total_running_seq_steps
            in_flight: dict[str, Entry] = {}
            while self._turn(in_flight):
                pass
        except BaseException as exc:  # a bug in the host or engine outside step(): fail loudly
            logger.exception("engine host loop died")
            with self._lock:
                self._dead = exc
                entries = list(self._live.values())
                self._pending.clear()
                self._live.clear()
                self._fanouts.clear()
                self._groups.clear()
                requests, self._stats_requests = self._stats_requests, []
                self._space.notify_all()
            for e in entries:
                fail(e.future, HostError("engine host loop died"), exc)
            for request in requests:
                fail(request.future, HostError("engine host loop died"), exc)
            raise

    def _turn(self, in_flight: dict[str, Entry]) -> bool:
        """One turn of the loop: wait for work, apply aborts and stats requests, admit, step.
        False when the host is shut down and drained. Its locals (the entries it admitted or
        aborted) end with it, so an idle loop holds nothing of finished work."""
        with self._lock:
            while (
                not (self._pending or self._to_abort or self._stats_requests or in_flight)
                and not self._closing
            ):
                self._guard = None  # idle: no urgent episode goes on
                self._work.wait()
            to_abort, self._to_abort = self._to_abort, []
            stats_requests, self._stats_requests = self._stats_requests, []
            admitted: list[Entry] = []
            if self._drain:
                skip = self._share_out(in_flight) if self._pending else frozenset()
                lesser_room = self._guard_urgent(in_flight)
                room = self.max_in_flight - len(in_flight)
                lead_room = self._lead_room(in_flight)
                if lead_room is not None:
                    room = min(room, lead_room)
                while room + self.reserved_seqs > 0 and self._pending:
                    # Past the cap, only urgent work enters (the reserved room), and only
                    # urgent work while the guard's room for the rest is used.
                    urgent_only = room <= 0 or lesser_room == 0
                    entry = self._pending.pop(-1 if urgent_only else None, skip)
                    if entry is None:
                        break
                    if entry.suspended is None and not _claim(entry):
                        self._forget(entry)  # the caller cancelled it while pending
                        continue
                    entry.state = IN_FLIGHT
                    admitted.append(entry)
                    room -= 1
                    if lesser_room is not None and entry.priority >= 0:
                        lesser_room -= 1
                if admitted:
                    self._space.notify_all()
                if self._lead is not None and not self._lead.ids:
                    self._lead.ids = frozenset(e.request_id for e in admitted)
            done = self._closing and not self._pending and not in_flight and not admitted
        for request in stats_requests:
            resolve_call(request.future, self._snapshot)
        if done and not to_abort:
            return False
        self._apply_aborts(to_abort, in_flight)
        self._admit(admitted, in_flight)
        self._num_in_flight = len(in_flight)
        if in_flight:
            self._step(in_flight)
        self._num_in_flight = len(in_flight)
        return True

    def _lead_room(self, in_flight: dict[str, Entry]) -> int | None:
        """How many requests the lead episode lets in now (None: no episode, no bound); the
        caller holds the lock. An episode starts when work reaches an idle engine and ends once
        a lead request leaves the engine (finished, aborted or suspended) or its steps run out.
        """
        lead = self._lead
        if lead is not None and (
            lead.steps_left <= 0 or not lead.ids or not lead.ids <= in_flight.keys()
        ):
            self._lead = lead = None
        if lead is not None:
            return 0
        if self.lead_requests and not in_flight and self._pending:
            self._lead = _Lead(steps_left=self.lead_steps)
            return self.lead_requests
        return None

    def _share_out(self, in_flight: dict[str, Entry]) -> frozenset[str | None]:
        """Carry out the fair-share plan (``engine.admission.fair_share``); the caller holds the lock.
        Returns the tenants that hold their share."""
        if not self.fair_share:
            return frozenset()
        plan = plan_shares(
            self._pending,
            list(in_flight.values()),
            max_num_seqs=self._max_num_seqs,
            free_room=self.max_in_flight - len(in_flight),
        )
        need = plan.need
        for entry in plan.candidates:
            if need == 0:
                break
            if self._suspend(entry, in_flight):
                need -= 1
        return plan.full

    def _guard_urgent(self, in_flight: dict[str, Entry]) -> int | None:
        """Carry out the urgent guard (``engine.admission.fair_share.guard_urgent``); the caller holds
        the lock. Returns how many less urgent requests may still be admitted (None: any)."""
        curve = getattr(self._engine, "step_cost", None)
        if self.urgent_slowdown is None or curve is None:
            return None
        slowdown, seqs = self.urgent_slowdown, self._max_num_seqs

        def room_for(peak: int) -> int:
            return curve.room(peak, slowdown, max(0, seqs - peak))

        plan = guard_urgent(
            list(in_flight.values()), self._pending.count_upto(-1), room_for, self._guard
        )
        for entry in plan.suspend:
            self._suspend(entry, in_flight)
        self._guard = replace(plan, suspend=[])  # the episode's bounds; no entries held
        return plan.room

    def _suspend(self, entry: Entry, in_flight: dict[str, Entry]) -> bool:
        """Suspend one in-flight request in the engine; it waits first in its batch. False if
        it cannot be (being aborted, finished in the last step, or n > 1)."""
        if entry.abort_requested:
            return False
        handle = self._engine.suspend_request(entry.request_id)
        if handle is None:
            return False
        del in_flight[entry.request_id]
        entry.suspended, entry.state = handle, PENDING
        self._pending.push(entry, front=True)
        self._counters.suspended += 1
        return True

    def _admit(self, admitted: list[Entry], in_flight: dict[str, Entry]) -> None:
        failures: list[tuple[Entry, BaseException]] = []
        for entry in admitted:
            if entry.suspended is not None:
                handle, entry.suspended = entry.suspended, None
                self._engine.resume_request(handle)
                in_flight[entry.request_id] = entry
                continue
            split_kw = {"completion_index": entry.index} if entry.index else {}
            try:
                self._engine.add_request(
                    entry.request_id,
                    entry.prompt_token_ids,
                    entry.params,
                    entry.priority,
                    cache_salt=entry.cache_salt,
                    **split_kw,
                )
            except Exception as exc:  # RequestError, or a bad argument the engine rejects
                failures.append((entry, exc))
                continue
            in_flight[entry.request_id] = entry
        if failures:
            with self._lock:
                for entry, _ in failures:
                    self._forget(entry)
                self._counters.failed += _requests(e for e, _ in failures)
            for entry, exc in failures:
                fail(entry.future, exc)

    def _apply_aborts(self, to_abort: list[Entry], in_flight: dict[str, Entry]) -> None:
        """Abort in the engine now (its KV blocks are freed at once). The engine reports each
        aborted request, with the tokens generated so far, from its next ``step()``; the
        future resolves then. One the engine no longer knows resolves here."""
        lost: list[Entry] = []
        for entry in to_abort:
            if in_flight.get(entry.request_id) is not entry:
                continue  # finished in the step that was running when the abort came
            try:
                known = self._engine.abort_request(entry.request_id)
            except Exception:
                logger.exception("aborting request %s failed", entry.request_id)
                known = False
            if not known:
                del in_flight[entry.request_id]
                lost.append(entry)
        self._finish([(e, abort_output(e)) for e in lost], aborted=_requests(lost))

    def _step(self, in_flight: dict[str, Entry]) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            self._counters.step_errors += 1
            logger.exception("engine step failed; failing %d in-flight requests", len(in_flight))
            entries = list(in_flight.values())
            in_flight.clear()
            for entry in entries:
                try:
                    self._engine.abort_request(entry.request_id)
                except Exception:
                    logger.exception("aborting request %s after a failed step", entry.request_id)
            # Requests already being aborted resolve as aborts; the rest carry the error.
            aborted = [e for e in entries if e.abort_requested]
            failed = [e for e in entries if not e.abort_requested]
            self._finish([(e, abort_output(e)) for e in aborted], aborted=_requests(aborted))
            with self._lock:
                for entry in failed:
                    self._forget(entry)
                self._counters.failed += _requests(failed)
            for entry in failed:
                fail(entry.future, EngineStepError(f"engine step failed: {exc!r}"), exc)
            return
        self._counters.steps += 1
        if self._lead is not None:
            self._lead.steps_left -= 1
        finished: list[tuple[Entry, RequestOutput]] = []
        aborted = 0
        for output in outputs:
            entry = in_flight.pop(output.request_id, None)
            if entry is None:
                continue
            finished.append((entry, output))
            if entry.fanout is None and any(c.finish_reason == "abort" for c in output.outputs):
                aborted += 1
        self._finish(finished, aborted=aborted)
        if in_flight and not outputs and not self._engine.has_unfinished_requests():
            # The engine forgot requests the host still waits on; never spin on them.
            lost = list(in_flight.values())
            in_flight.clear()
            with self._lock:
                for entry in lost:
                    self._forget(entry)
                self._counters.failed += _requests(lost)
            for entry in lost:
                fail(entry.future, EngineStepError("the engine dropped this request"))

    def _finish(self, finished: list[tuple[Entry, RequestOutput]], *, aborted: int) -> None:
        if not finished:
            return
        with self._lock:
            for entry, _ in finished:
                self._forget(entry)
            self._counters.aborted += aborted
            self._counters.completed += _requests(e for e, _ in finished) - aborted
        for entry, output in finished:
            resolve(entry.future, output)

    def _settle(self, fanout: Fanout, index: int, future: Future) -> None:
        """Completion ``index`` of a split request resolved (on whichever thread resolved it):
        the caller's future resolves with the request's output once every completion has
        one, or fails with the first error, and then its other completions are aborted."""
        error = future.exception()
        output = None if error is not None else future.result()
        with self._lock:
            merged, first_error = fanout.settle(index, output, error)
            counted = not fanout.future.cancelled()
            if merged is not None and counted:
                if any(c.finish_reason == "abort" for c in merged.outputs):
                    self._counters.aborted += 1
                else:
                    self._counters.completed += 1
            elif first_error is not None and counted:
                self._counters.failed += 1
        if merged is not None:
            resolve(fanout.future, merged)
        elif first_error is not None:
            fail(fanout.future, first_error)
            self._abort_where(lambda e: e.fanout is fanout, ids=fanout.member_ids())

    def _on_cancel(self, request_id: str, future: Future) -> None:
        """The caller cancelled a split request while it was pending: drop its completions.
        (By id, not by its :class:`Fanout`: the caller's future must not hold the fanout,
        which holds the future, or the two would wait for the cyclic collector.)"""
        if future.cancelled():
            self.abort(request_id)


def _claim(entry: Entry) -> bool:
    """Mark the caller's future running as ``entry`` is admitted; False if the caller
    cancelled it (or, for a completion of a split request, if the request already failed)."""
    if entry.fanout is None:
        return entry.future.set_running_or_notify_cancel()
    caller = entry.fanout.future
    if not caller.running():
        try:
            if not caller.set_running_or_notify_cancel():
                return False
        except RuntimeError:  # already failed, by another of its completions
            return False
    return entry.future.set_running_or_notify_cancel()


def _requests(entries: Iterable[Entry]) -> int:
    """How many of ``entries`` are requests of their own: the completions of a split request
    are counted once, when the request settles (``EngineHost._settle``)."""
    return sum(1 for e in entries if e.fanout is None)
