"""A thread-safe host that keeps one engine saturated while many producers feed it.

Producers call :meth:`EngineHost.submit` from any thread and get a future; only the loop thread
touches the engine, applying submissions, aborts and stats requests between two steps and
admitting what :class:`~engine.host.admit.Admission` chooses. Invariants: every future resolves
exactly once (an abort with ``finish_reason == "abort"``); a batch's pending requests are
bounded and a batch with none pending is let in; a failing step fails its in-flight futures and
the host keeps serving. The design is in docs/engine.md."""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from engine.core.engine import Engine
from engine.core.outputs import HostStats, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.urgent import UrgentReservation
from engine.host.admit import Admission
from engine.host.counters import Counters, count_requests
from engine.host.entry import (
    IN_FLIGHT,
    PENDING,
    Entry,
    Fanout,
    abort_output,
    claim,
    expected_tokens,
    fail,
    resolve,
    resolve_call,
    split,
)
from engine.host.live_entries import LiveEntries
from engine.host.policy import LeadEpisode

logger = logging.getLogger(__name__)


class HostError(RuntimeError):
    """The host cannot take the request: it is shut down, or its loop died."""


class HostQueueFull(TimeoutError):
    """``submit`` waited ``timeout`` seconds and the host's queue stayed full."""


class EngineStepError(RuntimeError):
    """``Engine.step()`` raised while this request was in flight; ``__cause__`` says why."""


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
        max_num_seqs = config.resolved_max_num_seqs
        if max_pending is None:
            max_pending = 2 * max_num_seqs
        if engine_backlog is None:
            engine_backlog = 0
        if group_window is None:
            group_window = max_num_seqs
        if engine_backlog < 0:
            raise ValueError(f"engine_backlog must be at least 0, got {engine_backlog}")
        self._engine = engine
        self._max_num_seqs = max_num_seqs
        lead = LeadEpisode(lead_requests, lead_steps)
        self.max_pending = max_pending
        self.group_window = group_window
        self.max_in_flight = max_num_seqs + engine_backlog
        # The host admits urgent work past its cap by the reservation's slots (Admission); the
        # engine's scheduler keeps the same slots free for it.
        reservation = UrgentReservation.of_share(
            reserved_share, max_num_seqs, int(config.max_num_batched_tokens)
        )
        reserve = getattr(getattr(engine, "scheduler", None), "reserve_for_urgent", None)
        if reserve is not None:
            reserve(reservation)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the loop waits here when idle
        self._space = threading.Condition(self._lock)  # producers wait here while full
        self._admission = Admission(
            max_num_seqs=max_num_seqs,
            max_pending=max_pending,
            group_window=group_window,
            max_in_flight=self.max_in_flight,
            reservation=reservation,
            fair_share=fair_share,
            urgent_slowdown=urgent_slowdown,
            aging_s=aging_s,
            lead=lead,
        )
        self._pending = self._admission.pending  # the queue the admission chooses from
        self._live = LiveEntries(self._pending)
        self._to_abort: list[Entry] = []  # in-flight entries the loop must abort in the engine
        self._stats_requests: list[_StatsRequest] = []
        self._num_in_flight = 0
        self._closing = False
        self._drain = True
        self._dead: BaseException | None = None
        self._counters = Counters()
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
        lora: str | None = None,
    ) -> Future:
        """Queue one request; block while its batch (``group``) holds its share of the host's
        queue (see the module docstring).

        ``priority`` is the request's tier: lower first (vLLM's convention), strictly, but for
        aging. ``tenant`` and ``group`` (the batch) make the flows that share a tier fairly.
        ``cache_salt`` scopes the prefix cache (see ``Engine.add_request``). ``deadline`` (unix
        seconds, the batch's) orders a tenant's batches in a tier: earliest deadline first.
        ``lora``: the registered LoRA adapter the request runs with (see
        ``Engine.add_request``); the engine refuses an unknown one (``AdapterError`` on the
        future).

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
            lora=lora,
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
                held, limit = self._admission.bound(group)
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
            self._live.add(entry.request_id, fanout, entries)
            self._counters.submitted += 1
            self._work.notify()
        return entry.future

    def abort(self, request_id: str) -> bool:
        """Abort one pending or in-flight request; False if it is unknown or already done."""
        with self._lock:
            fanout = self._live.fanout(request_id)
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
            ids = self._live.group_ids(group)
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
            candidates = self._live.select(ids)
            entries = [e for e in candidates if match(e) and not e.abort_requested]
            pending = [e for e in entries if e.state == PENDING]
            in_flight = [e for e in entries if e.state == IN_FLIGHT]
            if pending:
                self._pending.remove(pending)
                for e in pending:
                    self._live.forget(e)
                self._counters.aborted += count_requests(pending)
                self._space.notify_all()
            for e in in_flight:
                e.abort_requested = True
            if in_flight:
                self._to_abort.extend(in_flight)
                self._work.notify()
        for e in pending:
            resolve(e.future, abort_output(e))
        return len({id(e.fanout or e) for e in entries})

    def _snapshot(self) -> HostStats:
        engine_stats = self._engine.stats()
        with self._lock:
            pending = len(self._pending)
        return self._counters.snapshot(
            engine_stats,
            pending=pending,
            in_flight=self._num_in_flight,
            max_num_seqs=self._max_num_seqs,
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
                entries = self._live.clear()
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
                self._admission.idle()
                self._work.wait()
            to_abort, self._to_abort = self._to_abort, []
            stats_requests, self._stats_requests = self._stats_requests, []
            admitted: list[Entry] = []
            if self._drain:
                admitted = self._admission.choose(
                    in_flight,
                    getattr(self._engine, "step_cost", None),
                    lambda entry: self._suspend(entry, in_flight),
                    claim,
                    self._live.forget,
                )
                if admitted:
                    self._space.notify_all()
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
            split_kw: dict[str, Any] = {"completion_index": entry.index} if entry.index else {}
            if entry.lora is not None:
                split_kw["lora"] = entry.lora
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
                    self._live.forget(entry)
                self._counters.failed += count_requests(e for e, _ in failures)
            for entry, error in failures:
                fail(entry.future, error)

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
        self._finish([(e, abort_output(e)) for e in lost], aborted=count_requests(lost))

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
            aborting = [e for e in entries if e.abort_requested]
            failed = [e for e in entries if not e.abort_requested]
            self._finish([(e, abort_output(e)) for e in aborting], aborted=count_requests(aborting))
            with self._lock:
                for entry in failed:
                    self._live.forget(entry)
                self._counters.failed += count_requests(failed)
            for entry in failed:
                fail(entry.future, EngineStepError(f"engine step failed: {exc!r}"), exc)
            return
        self._counters.steps += 1
        self._admission.lead.stepped()
        finished: list[tuple[Entry, RequestOutput]] = []
        aborted = 0
        for output in outputs:
            done = in_flight.pop(output.request_id, None)
            if done is None:
                continue
            finished.append((done, output))
            if done.fanout is None and any(c.finish_reason == "abort" for c in output.outputs):
                aborted += 1
        self._finish(finished, aborted=aborted)
        if in_flight and not outputs and not self._engine.has_unfinished_requests():
            # The engine forgot requests the host still waits on; never spin on them.
            lost = list(in_flight.values())
            in_flight.clear()
            with self._lock:
                for entry in lost:
                    self._live.forget(entry)
                self._counters.failed += count_requests(lost)
            for entry in lost:
                fail(entry.future, EngineStepError("the engine dropped this request"))

    def _finish(self, finished: list[tuple[Entry, RequestOutput]], *, aborted: int) -> None:
        if not finished:
            return
        with self._lock:
            for entry, _ in finished:
                self._live.forget(entry)
            self._counters.aborted += aborted
            self._counters.completed += count_requests(e for e, _ in finished) - aborted
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
