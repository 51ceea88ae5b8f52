"""The dispatcher: to an upstream server what the engine host is to the engine.

Every shard of an upstream model in this process hands its requests to one :class:`Dispatcher`:
the engine host's fair queue orders them, a sender in one asyncio thread keeps its share of the
upstream's limit (:mod:`worker.upstream.shared_limit`) in flight, and a :class:`Reply` comes back on
each request's future. An overload puts its request back at the front and pauses sending; other
4xx are the request's own. Nothing here imports torch. Details: ``docs/upstream.md``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpx

from core.llms.specs import UpstreamSpec
from engine.host.fair_queue import FairQueue
from worker.upstream.concurrency import ConcurrencyController
from worker.upstream.guard import LiveGuard
from worker.upstream.shared_limit import Counters, LocalLimit, SharedLimit

logger = logging.getLogger(__name__)

SYNC_INTERVAL_S = 1.0
MAX_SERVER_ERRORS = 3
MAX_TIMEOUTS = 3
MAX_RETRY_AFTER_S = 60.0
UNREACHABLE_BACKOFF_S = (0.5, 30.0)  # first and longest pause while the server cannot be reached
OVERLOAD_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Reply:
    """The upstream's answer to one request: its status and JSON body (``text`` when the
    body was not JSON), and how long it took; ``aborted`` when it was cancelled first."""

    status: int = 0
    body: Any = None
    text: str = ""
    latency_s: float = 0.0
    aborted: bool = False


@dataclass(eq=False, slots=True)
class Job:
    """One request waiting for, or in, the upstream (an entry of the fair queue)."""

    path: str
    body: dict[str, Any]
    group: str | None
    tenant: str | None
    tier: int
    deadline: float | None
    cost: int
    rank: int
    future: Future = field(default_factory=Future)
    created: float = field(default_factory=time.monotonic)
    priority: int = 0
    timeouts: int = 0
    server_errors: int = 0

    def __post_init__(self) -> None:
        self.priority = self.tier

    @property
    def flow(self) -> tuple[str | None, str | None, int]:
        return (self.tenant, self.group, self.tier)


class Dispatcher:
    """The sender of one upstream model in this process (see the module docstring)."""

    def __init__(
        self,
        name: str,
        spec: UpstreamSpec,
        *,
        member: str | None = None,
        shared: bool = True,
        aging_s: float | None = None,
        initial_limit: int = 32,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.spec = spec
        self.member = member or f"{os.uname().nodename}:{os.getpid()}:{id(self):x}"
        controller = ConcurrencyController(
            initial=min(initial_limit, spec.max_concurrency), maximum=spec.max_concurrency
        )
        self.limit = (
            SharedLimit(name, self.member, controller) if shared else LocalLimit(controller)
        )
        self.guard = LiveGuard(spec) if spec.live else None
        self.headers = dict(headers or {})
        if spec.key_env:
            key = os.environ.get(spec.key_env)
            if key:
                self.headers["Authorization"] = f"Bearer {key}"
        self._lock = threading.Condition()
        self._queue: FairQueue[Job] = FairQueue(aging_s=aging_s)
        self._ranks: dict[str | None, dict[str, int]] = {}
        self._pending: dict[str | None, set[Job]] = collections.defaultdict(set)
        self._aborted: dict[str | None, float] = {}  # group -> when it was last aborted
        self._running: dict[str | None, set[asyncio.Task]] = collections.defaultdict(set)
        self._in_flight = 0
        self._share = controller.limit
        self._cut: int | None = None  # a local halving after an overload, until the next sync
        self._paused_until = 0.0
        self._unreachable = 0
        self.counters = Counters()
        self._busy_since = time.monotonic()
        self.backoffs: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self.tokenizer = None  # the handlers' interface: an upstream tokenizes its own prompts

    # -- the shard side (any thread)

    def start(self) -> Dispatcher:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"upstream-{self.name}", daemon=True
        )
        self._thread.start()
        ready.wait(10)
        return self

    def submit(
        self,
        path: str,
        body: dict[str, Any],
        *,
        group: str | None,
        tenant: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        cost: int = 1,
        prefix: str = "",
        callback: Callable[[Future], None] | None = None,
        timeout: float | None = None,
    ) -> Future:
        """Queue one request for the upstream; ``TimeoutError`` when its group already holds
        its window of pending requests for ``timeout`` seconds (the caller checkpoints and
        tries again). ``prefix`` groups the lines that share it inside their batch."""
        if self._closing:
            raise RuntimeError(f"the dispatcher of {self.name} is closed")
        with self._lock:
            if not self._lock.wait_for(
                lambda: self._queue.group_len(group) < self.group_window(), timeout
            ):
                raise TimeoutError(f"{self.name}: group {group} holds its window")
            ranks = self._ranks.setdefault(group, {})
            rank = ranks.setdefault(prefix, len(ranks))
            job = Job(path, body, group, tenant, priority, deadline, max(1, cost), rank)
            if callback is not None:
                job.future.add_done_callback(callback)
            self._push(job)
        self._poke()
        return job.future

    def group_window(self) -> int:
        """Pending requests a group may hold here: enough to refill its share twice over."""
        return max(16, 2 * self.allowed())

    def abort_group(self, group: str | None) -> None:
        """Drop ``group``'s pending requests and cancel those in flight (their connections
        close); each one's reply is ``aborted``."""
        with self._lock:
            now = time.monotonic()
            self._aborted = {g: t for g, t in self._aborted.items() if now - t < 600}
            self._aborted[group] = now
            gone = list(self._pending.pop(group, ()))
            self._queue.remove(gone)
            if group is not None:
                self._queue.forget_group(group)
            self._lock.notify_all()
        for job in gone:
            _settle(job, Reply(aborted=True))
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._cancel_group, group)

    def allowed(self) -> int:
        """Requests this process may have in flight now."""
        share = max(1, self._share if self._cut is None else min(self._share, self._cut))
        if self.guard is not None:
            share = min(share, self.guard.cap)  # 0: live traffic needs the upstream alone
        return share

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._queue)
        return {
            "kind": "upstream",
            "upstream": self.spec.base_url,
            "limit": self.limit.limit,
            "allowed": self.allowed(),
            "in_flight": self._in_flight,
            "pending": pending,
            "completed": self.counters.completed,
            "output_tokens": self.counters.output_tokens,
            "backoffs": dict(self.backoffs),
            "requests": dict(self.requests),
            "guard_cap": self.guard.cap if self.guard is not None else None,
            "ttft_p99_s": self.guard.ttft_p99_s if self.guard is not None else None,
            "leader": getattr(self.limit, "leader", True),
        }

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _load(self) -> tuple[int, int]:
        """Requests pending and in flight."""
        with self._lock:
            return len(self._queue), self._in_flight

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(
        self, wait: bool = True, abort_pending: bool = True, timeout: float | None = 30
    ) -> None:
        self._closing = True
        if abort_pending:
            with self._lock:
                gone = self._queue.clear()
                self._pending.clear()
            for job in gone:
                _settle(job, Reply(aborted=True))
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._stop_loop)
        if wait and self._thread is not None:
            self._thread.join(timeout)

    # -- the loop thread

    def _push(self, job: Job, front: bool = False) -> None:
        """Queue ``job`` (under the lock)."""
        self._queue.push(job, front=front)
        self._pending[job.group].add(job)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    def _stop_loop(self) -> None:
        for tasks in self._running.values():
            for task in tasks:
                _cancel_once(task)
        if self._wake is not None:
            self._wake.set()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        timeout = httpx.Timeout(self.spec.timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            self._client = client
            helpers = [asyncio.create_task(self._sync_loop())]
            if self.guard is not None:
                helpers.append(
                    asyncio.create_task(self.guard.run(client, self.headers, self._load))
                )
            assert self._wake is not None
            while not self._closing:
                self._dispatch()
                paused = self._paused_until - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), max(paused, 0.05) if paused > 0 else 0.5
                    )
                self._wake.clear()
            for task in helpers:
                task.cancel()
            running = [t for tasks in self._running.values() for t in tasks]
            for task in running:
                _cancel_once(task)
            await asyncio.gather(*running, *helpers, return_exceptions=True)
        if isinstance(self.limit, SharedLimit):
            try:
                await asyncio.to_thread(self.limit.leave)
            except Exception:
                logger.warning("%s: could not leave the shared limit", self.name, exc_info=True)

    def _dispatch(self) -> None:
        if time.monotonic() < self._paused_until:
            return
        while self._in_flight < self.allowed():
            with self._lock:
                job = self._queue.pop()
                if job is not None:
                    waiting = self._pending.get(job.group)
                    if waiting is not None:
                        waiting.discard(job)
                        if not waiting:
                            del self._pending[job.group]
                    self._lock.notify_all()
            if job is None:
                return
            self._account(+1)
            task = asyncio.ensure_future(self._send(job))
            self._running[job.group].add(task)
            task.add_done_callback(functools.partial(self._finished, job.group))

    def _finished(self, group: str | None, task: asyncio.Task) -> None:
        running = self._running.get(group)
        if running is not None:
            running.discard(task)
            if not running:
                del self._running[group]
                with self._lock:
                    if self._queue.group_len(group) == 0:
                        self._ranks.pop(group, None)
        self._account(-1)
        if self._wake is not None:
            self._wake.set()

    def _account(self, delta: int) -> None:
        now = time.monotonic()
        self.counters.busy_s += self._in_flight * (now - self._busy_since)
        self._busy_since = now
        self._in_flight += delta

    def _cancel_group(self, group: str | None) -> None:
        for task in list(self._running.get(group, ())):
            _cancel_once(task)

    async def _sync_loop(self) -> None:
        while True:
            with self._lock:
                demand = len(self._queue) + self._in_flight
            self._account(0)
            try:
                share = await asyncio.to_thread(self.limit.sync, demand, self.counters)
            except Exception as exc:  # a database blip: keep the last share
                logger.warning(
                    "%s: shared limit unavailable (%r); keeping %s", self.name, exc, self._share
                )
            else:
                self._share, self._cut = max(share, 1), None
            await asyncio.sleep(SYNC_INTERVAL_S)

    async def _send(self, job: Job) -> None:
        started = time.monotonic()
        try:
            response = await self._client.post(
                self.spec.base_url + job.path, json=job.body, headers=self.headers
            )
        except asyncio.CancelledError:
            _settle(job, Reply(aborted=True))
            raise
        except httpx.TimeoutException:
            job.timeouts += 1
            if job.timeouts >= MAX_TIMEOUTS:
                self.requests["timeout"] += 1
                _settle(job, Reply(status=504, text=self._timeout_text()))
                return
            self._overloaded("timeout", None)
            self._requeue(job)
            return
        except httpx.TransportError as exc:
            logger.warning("%s: %s unreachable: %r", self.name, self.spec.base_url, exc)
            if time.monotonic() >= self._paused_until:  # one step per try, not per request
                self._unreachable += 1
            first, longest = UNREACHABLE_BACKOFF_S
            pause = min(longest, first * 2 ** (self._unreachable - 1))
            # A server that is down says nothing about how much it can take: pause, keep the limit.
            self._overloaded("connection", pause, halve=False)
            self._requeue(job)
            return
        latency = time.monotonic() - started
        self._unreachable = 0
        status = response.status_code
        if status in OVERLOAD_STATUSES:
            self._overloaded(str(status), _retry_after(response.headers.get("retry-after")))
            self._requeue(job)
            return
        if status >= 500:
            job.server_errors += 1
            if job.server_errors < MAX_SERVER_ERRORS:
                self.requests["retried"] += 1
                self._requeue(job)
                return
        try:
            body = response.json()
        except ValueError:
            body = None
        self.requests[str(status)] += 1
        if status == 200:
            usage = body.get("usage") if isinstance(body, dict) else None
            tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
            self.counters.completed += 1
            self.counters.output_tokens += int(tokens or 0)
            self.counters.latency_s += latency
        _settle(job, Reply(status, body, response.text if body is None else "", latency))

    def _timeout_text(self) -> str:
        return (
            f"The upstream did not answer within timeout_s={self.spec.timeout_s:g} "
            f"{MAX_TIMEOUTS} times"
        )

    def _requeue(self, job: Job) -> None:
        with self._lock:
            if job.created <= self._aborted.get(job.group, float("-inf")):
                aborted = True  # its group was aborted while it was in flight
            else:
                aborted = False
                self._push(job, front=True)
        if aborted:
            _settle(job, Reply(aborted=True))

    def _overloaded(self, reason: str, pause_s: float | None, halve: bool = True) -> None:
        """One overload seen: count it, pause for ``pause_s``, and halve what may be in flight
        until the next sync, once: the requests already out when the server began refusing
        were sent under the old limit, and each of their refusals is the same news (halving
        for each, a burst of 64 timeouts cut the sender to one)."""
        self.backoffs[reason] += 1
        cut = halve and self._cut is None
        if halve:
            self.counters.overloads += 1
        if cut:
            self._cut = max(1, self._share // 2)
        if pause_s:
            self._paused_until = max(self._paused_until, time.monotonic() + pause_s)
        if not (cut or pause_s):
            return
        logger.info(
            "%s: upstream overloaded (%s); %s in flight allowed%s",
            self.name,
            reason,
            self.allowed(),
            f", pausing {pause_s:.1f} s" if pause_s else "",
        )


def _cancel_once(task: asyncio.Task) -> None:
    """Cancel ``task`` unless it is already being cancelled. httpx closes the connection of a
    cancelled request in a cleanup that a second cancel interrupts, leaving it open: the server
    would go on generating a request nobody waits for (two shards of a batch abort it, each
    twice)."""
    if not task.cancelling():
        task.cancel()


def _settle(job: Job, reply: Reply) -> None:
    if not job.future.done():
        job.future.set_result(reply)


def _retry_after(value: str | None) -> float:
    """``Retry-After`` in seconds (a number or an HTTP date), 1 s when absent, capped."""
    if not value:
        return 1.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 1.0
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
