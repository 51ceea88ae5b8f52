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

Shares of a full engine: in the most urgent pending tier below ``high``, each tenant with work
is due an equal share of ``max_num_seqs``. A tenant that arrives while another holds every
slot gets its share at once: the newest in-flight requests of tenants above their share (and
of less urgent tiers) are suspended in the engine (``Engine.suspend_request``: their KV is
freed, their output so far kept) and wait first in their batch, to resume where they stopped
when their tenant is below its share again (``fair_share=False`` turns this off). One tenant
alone keeps every slot.

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

import collections
import heapq
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from engine import (
    CompletionOutput,
    Engine,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

logger = logging.getLogger(__name__)

_PENDING, _IN_FLIGHT = "pending", "in_flight"


class HostError(RuntimeError):
    """The host cannot take the request: it is shut down, or its loop died."""


class HostQueueFull(TimeoutError):
    """``submit`` waited ``timeout`` seconds and the host's queue stayed full."""


class EngineStepError(RuntimeError):
    """``Engine.step()`` raised while this request was in flight; ``__cause__`` says why."""


@dataclass(slots=True)
class HostStats:
    """Engine stats plus the host's own counters, snapshotted between two steps."""

    engine: EngineStats | None
    pending: int  # in the host's queue, not yet handed to the engine
    in_flight: int  # handed to the engine, not finished
    submitted: int
    completed: int  # finished normally (stop or length)
    aborted: int
    failed: int  # RequestError, a step failure, or any other error set on the future
    step_errors: int
    steps: int  # engine steps run by this host
    suspended: int  # in-flight requests suspended to give another tenant its share
    mean_occupancy: float  # running sequences / max_num_seqs, averaged over this host's steps
    max_pending: int
    max_in_flight: int

    def as_dict(self) -> dict[str, Any]:
        """One flat dict: the engine's fields, then the host's (for JSON and logs)."""
        out: dict[str, Any] = {}
        if self.engine is not None:
            out.update(asdict(self.engine) if is_dataclass(self.engine) else vars(self.engine))
        for name in self.__slots__:
            if name != "engine":
                out[name] = getattr(self, name)
        return out


@dataclass(slots=True, eq=False)
class _Entry:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None
    future: Future
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    cost: int = 0  # tokens: prompt + expected output (max_tokens for each of n completions)
    state: str = _PENDING
    abort_requested: bool = False
    suspended: Any = None  # the engine's handle while suspended for another tenant's share

    @property
    def flow(self) -> tuple[str | None, str | None, int]:
        """The fair queue this entry waits in: its tenant's batch at its priority."""
        return self.tenant, self.group, self.priority


class _BatchQueue:
    """One batch's pending entries (a DRR flow inside its tenant), longest work first; arrival
    order for requests without a batch."""

    __slots__ = ("key", "tier", "heap", "deficit", "in_turn", "waiting_since", "max_cost")

    def __init__(self, key: tuple[str | None, str | None, int], tier: int, now: float) -> None:
        self.key = key
        self.tier = tier
        self.heap: list[tuple[int, int, _Entry]] = []
        self.deficit = 0
        self.in_turn = False
        self.waiting_since = now  # last admission, or when it started waiting
        self.max_cost = 0  # the largest request it has held since it started waiting


class _TenantQueue:
    """A tenant's batches within one tier (a DRR flow inside the tier)."""

    __slots__ = ("batches", "rotation", "deficit", "in_turn")

    def __init__(self) -> None:
        self.batches: dict[tuple[str | None, str | None, int], _BatchQueue] = {}
        self.rotation: collections.deque[tuple[str | None, str | None, int]] = collections.deque()
        self.deficit = 0
        self.in_turn = False


class _Tier:
    __slots__ = ("tenants", "rotation")

    def __init__(self) -> None:
        self.tenants: dict[str | None, _TenantQueue] = {}
        self.rotation: collections.deque[str | None] = collections.deque()


class FairQueue:
    """Pending requests, released by deficit round-robin on tokens. Not thread-safe: the host
    calls it under its lock.

    :meth:`pop` serves the most urgent tier (lowest ``priority``) that has work, strictly. In
    a tier, tenants take turns; each turn adds a quantum of tokens to the tenant's deficit,
    and the tenant is served while the cost of its next request fits in it. A tenant's turn is
    spent the same way across its batches, and a batch's own order is longest work first, as
    the engine's batch admission does (with few requests in the engine at a time, that order
    has to be applied here). The quantum is the largest request cost pending, the smallest
    that lets every turn serve at least one request (DRR's O(1) condition), so turns stay
    short: a batch that arrives joins the rotation at the back and is served after at most one
    turn of every other flow, never behind everything already queued. A flow that empties
    leaves the rotation and loses its deficit (no credit is saved up while idle).

    Aging: a batch of a tier above 0 (``low``) that has waited ``aging_s`` seconds without an
    admission moves one tier up, at most to 0 (``normal``), and stays there while it has work
    in the host, sharing that tier fairly. Urgent tiers (below 0) are never reached by aging:
    the room reserved for them is not to be taken by promoted bulk.
    """

    def __init__(
        self, aging_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.aging_s = aging_s
        self._clock = clock
        self._tiers: dict[int, _Tier] = {}
        self._batches: dict[tuple[str | None, str | None, int], _BatchQueue] = {}
        self._promoted: dict[tuple[str | None, str | None, int], int] = {}
        self._per_group: collections.Counter[str] = collections.Counter()
        self._order = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def group_len(self, group: str) -> int:
        return self._per_group.get(group, 0)

    @property
    def num_groups(self) -> int:
        return len(self._per_group)

    def push(self, entry: _Entry, front: bool = False) -> None:
        """Queue ``entry`` in its batch; ``front``: ahead of the batch's other requests (a
        request suspended in flight goes back first)."""
        bq = self._batches.get(entry.flow)
        if bq is None:
            tier = self._promoted.get(entry.flow, entry.priority)
            bq = self._batches[entry.flow] = _BatchQueue(entry.flow, tier, self._clock())
            self._activate(bq)
        bq.max_cost = max(bq.max_cost, entry.cost)
        longest_first = -entry.cost if entry.group is not None else 0
        if front:
            longest_first = -(1 << 62)
        heapq.heappush(bq.heap, (longest_first, next(self._order), entry))
        self._count(entry, +1)

    def pop(
        self, max_priority: int | None = None, skip: frozenset[str | None] = frozenset()
    ) -> _Entry | None:
        """The next entry to admit, or None; with ``max_priority``, only from tiers at or
        below it (the in-flight room reserved for urgent work). Tenants in ``skip`` are passed
        over in the most urgent tier (they hold their share while others wait for theirs)."""
        if self.aging_s is not None:
            self._age()
        for priority in sorted(self._tiers):
            if max_priority is not None and priority > max_priority:
                break
            return self._pop_tier(self._tiers[priority], skip)
        return None

    def top_tier(self) -> int | None:
        """The most urgent tier with pending work."""
        return min(self._tiers, default=None)

    def tenants_in(self, tier: int) -> dict[str | None, int]:
        """Pending requests per tenant in ``tier``."""
        t = self._tiers.get(tier)
        if t is None:
            return {}
        return {
            name: sum(len(bq.heap) for bq in tenant.batches.values())
            for name, tenant in t.tenants.items()
        }

    def remove(self, entries: Iterable[_Entry]) -> None:
        by_flow: dict[tuple[str | None, str | None, int], set[int]] = {}
        for e in entries:
            by_flow.setdefault(e.flow, set()).add(id(e))
        for flow, gone in by_flow.items():
            bq = self._batches.get(flow)
            if bq is None:
                continue
            kept = [item for item in bq.heap if id(item[2]) not in gone]
            for item in bq.heap:
                if id(item[2]) in gone:
                    self._count(item[2], -1)
            bq.heap = kept
            heapq.heapify(kept)
            if not kept:
                self._deactivate(bq)

    def forget_group(self, group: str) -> None:
        """``group`` has nothing pending or in flight any more: drop its promotions."""
        for flow in [f for f in self._promoted if f[1] == group]:
            del self._promoted[flow]

    def clear(self) -> list[_Entry]:
        entries = [item[2] for bq in self._batches.values() for item in bq.heap]
        self.__init__(self.aging_s, self._clock)  # type: ignore[misc]
        return entries

    # -- internals

    def _count(self, entry: _Entry, delta: int) -> None:
        self._len += delta
        if entry.group is not None:
            self._per_group[entry.group] += delta
            if self._per_group[entry.group] <= 0:
                del self._per_group[entry.group]

    def _activate(self, bq: _BatchQueue) -> None:
        tier = self._tiers.setdefault(bq.tier, _Tier())
        tenant_name = bq.key[0]
        tenant = tier.tenants.get(tenant_name)
        if tenant is None:
            tenant = tier.tenants[tenant_name] = _TenantQueue()
            tier.rotation.append(tenant_name)
        tenant.batches[bq.key] = bq
        tenant.rotation.append(bq.key)

    def _deactivate(self, bq: _BatchQueue, keep: bool = False) -> None:
        tier = self._tiers[bq.tier]
        tenant_name = bq.key[0]
        tenant = tier.tenants[tenant_name]
        del tenant.batches[bq.key]
        tenant.rotation.remove(bq.key)
        if not tenant.batches:
            del tier.tenants[tenant_name]
            tier.rotation.remove(tenant_name)
        if not tier.tenants:
            del self._tiers[bq.tier]
        if not keep:
            del self._batches[bq.key]

    def _age(self) -> None:
        deadline = self._clock() - self.aging_s  # type: ignore[operator]
        for bq in list(self._batches.values()):
            if bq.tier > 0 and bq.waiting_since < deadline:
                self._deactivate(bq, keep=True)
                bq.tier -= 1
                bq.deficit, bq.in_turn = 0, False
                bq.waiting_since = self._clock()
                if bq.key[1] is not None:
                    self._promoted[bq.key] = bq.tier
                self._activate(bq)

    def _quantum(self) -> int:
        return max(bq.max_cost for bq in self._batches.values())

    def _pop_tier(self, tier: _Tier, skip: frozenset[str | None] = frozenset()) -> _Entry | None:
        if skip and all(name in skip for name in tier.rotation):
            return None
        while True:
            if tier.rotation[0] in skip:
                tier.rotation.rotate(-1)
                continue
            tenant = tier.tenants[tier.rotation[0]]
            if not tenant.in_turn:
                tenant.in_turn, tenant.deficit = True, tenant.deficit + self._quantum()
            bq = tenant.batches[tenant.rotation[0]]
            cost = bq.heap[0][2].cost
            if tenant.deficit < cost:  # the tenant's turn is spent
                tenant.in_turn = False
                tier.rotation.rotate(-1)
                continue
            if not bq.in_turn:
                bq.in_turn, bq.deficit = True, bq.deficit + self._quantum()
            if bq.deficit < cost:  # this batch's part of the turn is spent
                bq.in_turn = False
                tenant.rotation.rotate(-1)
                continue
            entry = heapq.heappop(bq.heap)[2]
            self._count(entry, -1)
            tenant.deficit -= cost
            bq.deficit -= cost
            bq.waiting_since = self._clock()
            entry.priority = min(entry.priority, bq.tier)  # what the engine is told
            if not bq.heap:
                self._deactivate(bq)
            return entry


@dataclass(slots=True)
class _Counters:
    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    step_errors: int = 0
    steps: int = 0
    suspended: int = 0  # in-flight requests suspended to give another tenant its share
    base_steps: int | None = None  # engine counters when the host started, for its own means
    base_running_seq_steps: int = 0


@dataclass(slots=True)
class _StatsRequest:
    future: Future = field(default_factory=Future)


class EngineHost:
    """Own one :class:`Engine` on a background thread; accept work from any thread.

    ``EngineHost(engine)`` wraps an engine built by the caller (it must not be used by anyone
    else afterwards); ``EngineHost.from_model(model_dir, **config)`` builds one.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_pending: int | None = None,
        engine_backlog: int | None = None,
        group_window: int | None = None,
        reserved_share: float = 0.0,
        aging_s: float | None = None,
        fair_share: bool = True,
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
        if aging_s is not None and aging_s <= 0:
            raise ValueError(f"aging_s must be positive (or None for no aging), got {aging_s}")
        self._engine = engine
        self._max_num_seqs = max_num_seqs
        self.fair_share = fair_share
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
        self._live: dict[str, _Entry] = {}  # pending and in flight, by request id
        self._groups: dict[str, set[str]] = {}
        self._to_abort: list[_Entry] = []  # in-flight entries the loop must abort in the engine
        self._stats_requests: list[_StatsRequest] = []
        self._num_in_flight = 0
        self._closing = False
        self._drain = True
        self._dead: BaseException | None = None
        self._counters = _Counters()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    @classmethod
    def from_model(
        cls,
        model_dir: str,
        *,
        max_pending: int | None = None,
        engine_backlog: int | None = None,
        group_window: int | None = None,
        reserved_share: float = 0.0,
        aging_s: float | None = None,
        **config: Any,
    ) -> EngineHost:
        return cls(
            Engine(model_dir, **config),
            max_pending=max_pending,
            engine_backlog=engine_backlog,
            group_window=group_window,
            reserved_share=reserved_share,
            aging_s=aging_s,
        )

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
    ) -> Future:
        """Queue one request; block while its batch (``group``) holds its share of the host's
        queue (see the module docstring).

        ``priority`` is the request's tier: lower first (vLLM's convention), strictly, but for
        aging. ``tenant`` and ``group`` (the batch) make the flows that share a tier fairly.
        ``cache_salt`` scopes the prefix cache (see ``Engine.add_request``).

        Returns a future that resolves with the request's :class:`RequestOutput` (also for an
        abort), or raises ``RequestError`` (the engine refused it) or :class:`EngineStepError`.
        ``callback(future)`` runs when it resolves, on whichever thread resolves it (usually
        the loop thread): keep it short. ``timeout`` bounds the wait for queue space and
        raises :class:`HostQueueFull`.
        """
        params = params if params is not None else SamplingParams()
        prompt = list(prompt_token_ids)
        entry = _Entry(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt_token_ids=prompt,
            params=params,
            group=group,
            future=Future(),
            arrival_time=time.time(),
            priority=int(priority),
            cache_salt=cache_salt,
            tenant=tenant,
            cost=_expected_tokens(prompt, params),
        )
        if callback is not None:
            entry.future.add_done_callback(callback)
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
            if entry.request_id in self._live:
                raise ValueError(f"request id {entry.request_id!r} is already pending or in flight")
            self._live[entry.request_id] = entry
            if group is not None:
                self._groups.setdefault(group, set()).add(entry.request_id)
            self._pending.push(entry)
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

    def submit_many(
        self,
        prompts: Iterable[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        group: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> list[Future]:
        return [
            self.submit(p, params, group=group, timeout=timeout, priority=priority, tenant=tenant)
            for p in prompts
        ]

    def abort(self, request_id: str) -> bool:
        """Abort one pending or in-flight request; False if it is unknown or already done."""
        return self._abort_where(lambda e: e.request_id == request_id, ids=[request_id]) > 0

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

    def _abort_where(
        self, match: Callable[[_Entry], bool], ids: Iterable[str] | None = None
    ) -> int:
        with self._lock:
            candidates = (
                [self._live[i] for i in ids if i in self._live]
                if ids is not None
                else list(self._live.values())
            )
            entries = [e for e in candidates if match(e) and not e.abort_requested]
            pending = [e for e in entries if e.state == _PENDING]
            in_flight = [e for e in entries if e.state == _IN_FLIGHT]
            if pending:
                self._pending.remove(pending)
                for e in pending:
                    self._forget(e)
                self._counters.aborted += len(pending)
                self._space.notify_all()
            for e in in_flight:
                e.abort_requested = True
            if in_flight:
                self._to_abort.extend(in_flight)
                self._work.notify()
        for e in pending:
            _resolve(e.future, _abort_output(e))
        return len(entries)

    def _forget(self, entry: _Entry) -> None:
        """Drop an entry from the indexes; the caller holds the lock."""
        self._live.pop(entry.request_id, None)
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
            in_flight: dict[str, _Entry] = {}
            while True:
                with self._lock:
                    while (
                        not (self._pending or self._to_abort or self._stats_requests or in_flight)
                        and not self._closing
                    ):
                        self._work.wait()
                    to_abort, self._to_abort = self._to_abort, []
                    stats_requests, self._stats_requests = self._stats_requests, []
                    admitted: list[_Entry] = []
                    if self._drain:
                        skip = self._share_out(in_flight) if self._pending else frozenset()
                        room = self.max_in_flight - len(in_flight)
                        while room + self.reserved_seqs > 0 and self._pending:
                            # Past the cap, only urgent work enters (the reserved room).
                            entry = self._pending.pop(None if room > 0 else -1, skip)
                            if entry is None:
                                break
                            if (
                                entry.suspended is None
                                and not entry.future.set_running_or_notify_cancel()
                            ):
                                self._forget(entry)  # the caller cancelled it while pending
                                continue
                            entry.state = _IN_FLIGHT
                            admitted.append(entry)
                            room -= 1
                        if admitted:
                            self._space.notify_all()
                    done = self._closing and not self._pending and not in_flight and not admitted
                for request in stats_requests:
                    _resolve_call(request.future, self._snapshot)
                if done and not to_abort:
                    break
                self._apply_aborts(to_abort, in_flight)
                self._admit(admitted, in_flight)
                self._num_in_flight = len(in_flight)
                if in_flight:
                    self._step(in_flight)
                self._num_in_flight = len(in_flight)
        except BaseException as exc:  # a bug in the host or engine outside step(): fail loudly
            logger.exception("engine host loop died")
            with self._lock:
                self._dead = exc
                entries = list(self._live.values())
                self._pending.clear()
                self._live.clear()
                self._groups.clear()
                requests, self._stats_requests = self._stats_requests, []
                self._space.notify_all()
            for e in entries:
                _fail(e.future, HostError("engine host loop died"), exc)
            for request in requests:
                _fail(request.future, HostError("engine host loop died"), exc)
            raise

    def _share_out(self, in_flight: dict[str, _Entry]) -> frozenset[str | None]:
        """Fair shares of the engine's sequences among tenants; the caller holds the lock.

        In the most urgent tier with pending work (``normal`` or ``low``; the urgent tiers
        have their reservation), each tenant with work there is due an equal share of
        ``max_num_seqs``. A tenant below its share that has requests waiting gets room at
        once: when the engine is full, the newest in-flight requests of less urgent tiers,
        then of tenants above their share, are suspended in the engine (their KV freed, what
        they generated kept) and wait first in their batch; they resume when their tenant is
        below its share again. Returns the tenants that hold their share, which admission
        passes over while another waits for its own. One tenant alone keeps every slot."""
        if not self.fair_share:
            return frozenset()
        tier = self._pending.top_tier()
        if tier is None or tier < 0:
            return frozenset()
        pending = self._pending.tenants_in(tier)
        running = collections.Counter(e.tenant for e in in_flight.values() if e.priority == tier)
        active = set(pending) | set(running)
        lesser = [e for e in in_flight.values() if e.priority > tier]
        if len(active) < 2 and not lesser:
            return frozenset()
        share = max(1, self._max_num_seqs // len(active))
        want = sum(min(n, share - running[t]) for t, n in pending.items() if running[t] < share)
        if not want:
            return frozenset()
        need = want - max(0, self.max_in_flight - len(in_flight))
        if need > 0:
            over = {t: n - share for t, n in running.items() if n > share}
            victims = lesser[::-1] + [
                e for e in reversed(in_flight.values()) if e.priority == tier and e.tenant in over
            ]
            for entry in victims:
                if need == 0:
                    break
                if entry.priority == tier:
                    if over[entry.tenant] == 0:
                        continue
                    over[entry.tenant] -= 1
                if entry.abort_requested:
                    continue
                handle = self._engine.suspend_request(entry.request_id)
                if handle is None:  # finished in the last step, or n > 1
                    continue
                del in_flight[entry.request_id]
                entry.suspended, entry.state = handle, _PENDING
                self._pending.push(entry, front=True)
                self._counters.suspended += 1
                need -= 1
        return frozenset(t for t in active if running[t] >= share)

    def _admit(self, admitted: list[_Entry], in_flight: dict[str, _Entry]) -> None:
        failures: list[tuple[_Entry, BaseException]] = []
        for entry in admitted:
            if entry.suspended is not None:
                handle, entry.suspended = entry.suspended, None
                self._engine.resume_request(handle)
                in_flight[entry.request_id] = entry
                continue
            try:
                self._engine.add_request(
                    entry.request_id,
                    entry.prompt_token_ids,
                    entry.params,
                    entry.priority,
                    cache_salt=entry.cache_salt,
                )
            except Exception as exc:  # RequestError, or a bad argument the engine rejects
                failures.append((entry, exc))
                continue
            in_flight[entry.request_id] = entry
        if failures:
            with self._lock:
                for entry, _ in failures:
                    self._forget(entry)
                self._counters.failed += len(failures)
            for entry, exc in failures:
                _fail(entry.future, exc)

    def _apply_aborts(self, to_abort: list[_Entry], in_flight: dict[str, _Entry]) -> None:
        """Abort in the engine now (its KV blocks are freed at once). The engine reports each
        aborted request, with the tokens generated so far, from its next ``step()``; the
        future resolves then. One the engine no longer knows resolves here."""
        lost: list[_Entry] = []
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
        self._finish([(e, _abort_output(e)) for e in lost], aborted=len(lost))

    def _step(self, in_flight: dict[str, _Entry]) -> None:
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
            self._finish([(e, _abort_output(e)) for e in aborted], aborted=len(aborted))
            with self._lock:
                for entry in failed:
                    self._forget(entry)
                self._counters.failed += len(failed)
            for entry in failed:
                _fail(entry.future, EngineStepError(f"engine step failed: {exc!r}"), exc)
            return
        self._counters.steps += 1
        finished: list[tuple[_Entry, RequestOutput]] = []
        aborted = 0
        for output in outputs:
            entry = in_flight.pop(output.request_id, None)
            if entry is None:
                continue
            finished.append((entry, output))
            if any(c.finish_reason == "abort" for c in output.outputs):
                aborted += 1
        self._finish(finished, aborted=aborted)
        if in_flight and not outputs and not self._engine.has_unfinished_requests():
            # The engine forgot requests the host still waits on; never spin on them.
            lost = list(in_flight.values())
            in_flight.clear()
            with self._lock:
                for entry in lost:
                    self._forget(entry)
                self._counters.failed += len(lost)
            for entry in lost:
                _fail(entry.future, EngineStepError("the engine dropped this request"))

    def _finish(self, finished: list[tuple[_Entry, RequestOutput]], *, aborted: int) -> None:
        if not finished:
            return
        with self._lock:
            for entry, _ in finished:
                self._forget(entry)
            self._counters.aborted += aborted
            self._counters.completed += len(finished) - aborted
        for entry, output in finished:
            _resolve(entry.future, output)


def _expected_tokens(prompt: list[int], params: SamplingParams) -> int:
    """A request's cost for fair sharing: its prompt plus the output it may generate."""
    n = max(1, int(getattr(params, "n", 1) or 1))
    return len(prompt) + n * int(getattr(params, "max_tokens", 0) or 0)


def _abort_output(entry: _Entry) -> RequestOutput:
    now = time.time()
    n = max(1, int(getattr(entry.params, "n", 1) or 1))
    return RequestOutput(
        request_id=entry.request_id,
        prompt_token_ids=list(entry.prompt_token_ids),
        outputs=[
            CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                finish_reason="abort",
                stop_reason=None,
                logprobs=None,
            )
            for i in range(n)
        ],
        finished=True,
        metrics=RequestMetrics(
            arrival_time=entry.arrival_time,
            first_token_time=None,
            finished_time=now,
            num_cached_tokens=0,
        ),
        error=None,
    )


def _resolve(future: Future, output: RequestOutput) -> None:
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_result(output)


def _fail(future: Future, error: BaseException, cause: BaseException | None = None) -> None:
    if cause is not None and error is not cause:
        error.__cause__ = cause
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error)


def _resolve_call(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)
