"""One attempt at one shard: read its lines, feed the process's engine host (or embedding host),
collect results, checkpoint them (see :class:`ShardRun`)."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from core.batchfile.reader import RawLine, custom_id_of, parse_request
from core.batchfile.request import BatchRequest, LineError
from core.database.lifecycle import ShardStatus
from core.database.tables import Batch, Shard
from core.llms import specs
from core.llms.generation import error_for_exception, error_record
from core.observability import metrics
from core.observability.logs import log_context
from core.settings import get_settings
from worker.handler import Aborted, EngineUnavailable, Failed, Line, Refused
from worker.host_contract import Host
from worker.infra import runtime, storage
from worker.infra.drain import Drain, process_drain
from worker.shards import timings
from worker.shards.checkpoints import own_lines, shard_lines
from worker.shards.handlers import handler_for
from worker.shards.prepared import in_run_order, read_order
from worker.shards.state import Heartbeat, Pending, ShardLost, batch_state, commit_chunk

logger = logging.getLogger(__name__)


STATUS_POLL_S = 1.0
MAX_ABORT_RETRIES = 3  # a request aborted while its batch is still running is run again
ABORT_WAIT_S = 10.0  # a draining shard's wait for its aborted requests to come back
STATS_TIMEOUT_S = 10.0
STATS_PATIENCE = 3  # stats asks that time out in a row before the host is taken for dead


class ShardRun:
    """One attempt at one shard. ``after_commit(chunk)`` is a test seam called after each
    committed checkpoint.

    Engine failures are retried per request. A ``RequestError`` (the engine refused the
    request) is submitted again, up to ``max_request_attempts`` tries in all. A failed engine
    step fails every request in flight in that step, most of them bystanders; each of them
    becomes a *suspect* and, once this shard has fed all its requests, is run again **alone**:
    the shard takes the host's isolation gate (other shards of this process pause their
    submissions), waits for the engine to drain, and runs its suspects one at a time. A
    suspect that fails alone ``max_request_attempts`` times is reported as a ``server_error``
    line; the shard and the worker go on.

    When the worker drains (SIGTERM, :mod:`worker.infra.drain`) the run feeds the host no
    more; the requests in flight finish and are checkpointed until the drain is due, then the
    rest are aborted. What did not finish gets no line: :meth:`run` returns ``pending`` and the
    shard is handed back, for the attempt that resumes it to run. A paused batch is the same
    without the drain's deadline: the lines in flight finish, and the rest wait for the resume
    (``pausing``).

    A batch with a token budget (``max_total_tokens``) starts a line only while the tokens
    spent stay under it: see :meth:`_budget_admits`; a line it does not start ends as a
    ``budget_exhausted`` error line.
    """

    def __init__(
        self,
        shard: Shard,
        batch: Batch,
        key: str,
        attempt: int,
        num_chunks: int,
        done_lines: set[int],
        host: Host,
        after_commit: Callable[[int], None] | None = None,
        drain: Drain | None = None,
    ):
        settings = get_settings()
        self.shard = shard
        self.batch_id = batch.id
        self.tenant = batch.tenant
        self.endpoint = batch.endpoint
        self.model = batch.model or ""
        self.key = key
        self.attempt = attempt
        self.chunk = num_chunks
        self.done_lines = done_lines
        self.host = host
        # What differs between generation and embeddings (prepare, submit, read the outcome).
        self.handler = handler_for(shard, batch, host)
        # an upstream model's lines are parsed as validation parsed them (core.batchfile.bodies.check_body),
        # with the reserved fields its spec allows now
        self.forwarded: dict[str, frozenset[str]] = (
            specs.forwarded_models(settings.models)  # the model's and its adapters'
            if self.handler.forwards_bodies
            else {}
        )
        self.every = max(1, settings.checkpoint_every)
        self.interval = settings.checkpoint_interval_s
        self.max_request_attempts = max(1, settings.max_request_attempts)
        self.after_commit = after_commit
        self.done_q: queue.SimpleQueue[tuple[BatchRequest, Any, Any, Future, bool]] = (
            queue.SimpleQueue()
        )
        self.pending = Pending()
        self.in_flight = 0
        self.ran = 0
        self.stopping = False
        self.drain = drain or process_drain()
        self.draining = False
        self.pausing = False  # the batch was paused: a drain without a deadline
        self.budget = batch.max_total_tokens
        # Tokens spent: the batch's as last read, plus what this run committed since then.
        self.spent_read = (batch.input_tokens or 0) + (batch.output_tokens or 0)
        self.spent_since = 0
        self.reserved: dict[int, int] = {}  # line in flight -> its worst case in tokens
        self.fed_all = False  # every line not done before was handed to the host
        self.dropped = 0  # requests that came back without a line while draining
        self.retries: dict[int, int] = {}
        self.to_retry: list[tuple[BatchRequest, Any, Any]] = []
        self.refusals: dict[int, int] = {}  # RequestError count per line
        # failed runs per line that count toward max_request_attempts (for generation, those
        # of a request run alone)
        self.failures: dict[int, int] = {}
        self.suspects: list[tuple[BatchRequest, Any, Any]] = []
        self.stats_timeouts = 0
        self.suspect_line: int | None = None
        # line -> when it was handed to the host (worker.shards.timings)
        self.submitted_at: dict[int, float] = {}
        self.gate = runtime.isolation_gate(host)
        self.heartbeat: Heartbeat | None = None
        self._last_checkpoint = time.monotonic()
        self._last_poll = time.monotonic()

    # -- bookkeeping

    def _checkpoint(self, force: bool = False) -> None:
        """Commit full chunks of ``checkpoint_every`` results; a partial one when the interval
        has passed or ``force``. A shard's first chunk is its first result alone, committed as
        soon as it comes: a batch's first result is visible without waiting for a full chunk."""
        while self.pending:
            n = len(self.pending)
            late = time.monotonic() - self._last_checkpoint >= self.interval
            first = self.chunk == 0
            if n < self.every and not (force or late or first):
                return
            chunk = self.pending.take(1 if first else self.every)
            commit_chunk(self.shard, self.attempt, self.chunk, chunk)
            self.spent_since += chunk.input_tokens + chunk.output_tokens
            timings.record_commit(self.batch_id, chunk.finished, time.time())
            metrics.record_chunk(self.model, self.tenant, chunk)
            self.chunk += 1
            self.ran += len(chunk)
            self._last_checkpoint = time.monotonic()
            if self.after_commit is not None:
                self.after_commit(self.chunk)
        self._last_checkpoint = time.monotonic()

    def _poll(self, force: bool = False) -> None:
        if self.heartbeat is not None and self.heartbeat.lost.is_set():
            raise ShardLost(f"shard {self.shard.id} attempt {self.attempt} was reclaimed")
        if not self.draining and self.drain.started:
            self.draining = True
            logger.info(
                "shard %s attempt %s drains: %s requests in flight, %.0fs to finish",
                self.shard.id,
                self.attempt,
                self.in_flight,
                self.drain.left_s(),
            )
        now = time.monotonic()
        if force or now - self._last_poll >= STATUS_POLL_S:
            self._last_poll = now
            state = batch_state(self.batch_id)
            self.spent_read, self.spent_since = state.spent, 0
            if not self.stopping and state.stopping:
                logger.info(
                    "batch %s is stopping; shard %s aborts", self.batch_id, self.shard.index
                )
                self.stopping = True
                self.host.abort_group(self.batch_id)
            elif state.paused and not self.draining:
                logger.info(
                    "batch %s is paused; shard %s lets %s requests in flight finish",
                    self.batch_id,
                    self.shard.index,
                    self.in_flight,
                )
                self.pausing = self.draining = True

    def _collect(self, block_s: float = 0.0) -> None:
        """Move finished requests into the pending chunk."""
        try:
            item = self.done_q.get(timeout=block_s) if block_s > 0 else self.done_q.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.done_q.get_nowait()
            except queue.Empty:
                return

    def _handle(
        self, req: BatchRequest, prompt: Any, params: Any, future: Future, alone: bool
    ) -> None:
        """Turn a request the host is done with into its line, or run it again (see the
        class docstring)."""
        self.in_flight -= 1
        self.reserved.pop(req.line, None)
        if alone:
            self.suspect_line = None
        with log_context(request_id=req.custom_id):
            self._settle(req, prompt, params, future, alone)

    def _settle(
        self, req: BatchRequest, prompt: Any, params: Any, future: Future, alone: bool
    ) -> None:
        outcome = self.handler.outcome(req, future, self.submitted_at.pop(req.line, None))
        work = (req, prompt, params)
        if self.draining and not isinstance(outcome, Line):
            self.dropped += 1  # no line: the attempt that resumes the shard runs it
            return
        if isinstance(outcome, Line):
            if outcome.result is None:
                self.pending.add_error(req.line, outcome.record)
            else:
                self.pending.add_ok(req.line, outcome.record, outcome.result, outcome.finished)
        elif isinstance(outcome, Aborted):
            # Part of a cancel or expiry (the finalize writes its error line), or, if the
            # batch is still running, something else aborted it: run it again.
            tries = self.retries.get(req.line, 0) + 1
            self.retries[req.line] = tries
            if tries <= MAX_ABORT_RETRIES:
                self.to_retry.append(work)
            else:
                self.pending.add_error(req.line, outcome.record)
        elif isinstance(outcome, Refused):
            tries = self.refusals.get(req.line, 0) + 1
            self.refusals[req.line] = tries
            if tries < self.max_request_attempts:
                self.to_retry.append(work)
            else:
                self.pending.add_error(req.line, error_for_exception(req, outcome.exc))
        elif isinstance(outcome, Failed):
            isolate = self.handler.isolates_failures
            if isolate and not alone:
                self.suspects.append(work)
                return
            tries = self.failures.get(req.line, 0) + 1
            self.failures[req.line] = tries
            if tries < self.max_request_attempts:
                (self.suspects if isolate else self.to_retry).append(work)
            else:
                self.pending.add_error(req.line, self.handler.failed_line(req, outcome.exc, tries))

    def _submit(self, req: BatchRequest, prompt: Any, params: Any, alone: bool = False) -> bool:
        """Hand one request to the host; False if the shard stopped first. Ordinary
        submissions wait while another shard isolates its suspects."""

        def done(fut: Future, req: BatchRequest = req) -> None:
            self.done_q.put((req, prompt, params, fut, alone))

        while not (self.stopping or self.draining):
            if not alone and self.gate.held_by_other(self):
                self._collect(block_s=0.05)
                self._checkpoint()
                self._poll()
                continue
            self.submitted_at[req.line] = time.time()
            if self.budget is not None:
                self.reserved[req.line] = worst_case_tokens(prompt, params)
            try:
                self.handler.submit(prompt, params, done)
            except TimeoutError:  # HostQueueFull, the embedding host's or the dispatcher's
                self.reserved.pop(req.line, None)
                self._collect()
                self._checkpoint()
                self._poll()
                continue
            except ValueError as exc:  # refused at submission
                self.reserved.pop(req.line, None)
                self.pending.add_error(req.line, error_for_exception(req, exc))
                return True
            self.in_flight += 1
            return True
        return False

    def _host_idle(self) -> bool:
        """Whether the engine has drained. A host that does not answer for
        ``STATS_PATIENCE`` asks in a row is taken for dead (the attempt fails, the shard is
        reclaimed); until then a slow answer only means not yet."""
        try:
            drained = self.handler.drained(STATS_TIMEOUT_S)
        except TimeoutError:
            self.stats_timeouts += 1
            logger.warning(
                "shard %s: the engine host did not answer for stats (%s in a row)",
                self.shard.id,
                self.stats_timeouts,
            )
            if self.stats_timeouts >= STATS_PATIENCE:
                raise EngineUnavailable("the engine host stopped answering") from None
            return False
        self.stats_timeouts = 0
        return drained

    def _advance_suspects(self) -> None:
        """Run the next suspect alone once the engine has drained (see the class docstring)."""
        if self.stopping or self.draining or self.suspect_line is not None:
            return
        if not self.suspects:
            self.gate.release(self)
            return
        if not self.gate.try_acquire(self) or self.in_flight or not self._host_idle():
            return
        req, ids, params = self.suspects.pop(0)
        self.suspect_line = req.line
        if not self._submit(req, ids, params, alone=True):
            self.suspect_line = None
            self.suspects.insert(0, (req, ids, params))

    # -- the loop

    def run(self) -> ShardStatus:
        """Return ``done``, ``stopped``, or ``pending`` when the worker drained before the
        shard's end (it is to be handed back); raise ShardLost if this attempt lost the shard."""
        self.heartbeat = Heartbeat(self.shard.id, self.attempt).start()
        try:
            self._feed()
            while not (self.stopping or self.draining) and (
                self.in_flight or self.to_retry or self.suspects
            ):
                if self.to_retry:
                    self._poll(force=True)  # was the abort a cancel this shard has not seen?
                    if self.stopping:
                        break
                retry, self.to_retry = self.to_retry, []
                for k, (req, ids, params) in enumerate(retry):
                    if not self._submit(req, ids, params):
                        self.to_retry.extend(retry[k:])  # stopping or draining: not run here
                        break
                self._advance_suspects()
                self._collect(block_s=0.2 if self.in_flight else 0.05)
                self._checkpoint()
                self._poll()
            if self.stopping:
                self.host.abort_group(self.batch_id)
                deadline = time.monotonic() + 30
                while self.in_flight and time.monotonic() < deadline:
                    self._collect(block_s=0.2)
                self.to_retry.clear()  # never-finished requests are the finalize's to report
                self.suspects.clear()
            elif self.draining:
                self._drain()
            self._checkpoint(force=True)
        except ShardLost:
            if self.stopping:
                self.host.abort_group(self.batch_id)
            raise
        finally:
            self.gate.release(self)
            self.heartbeat.stop()
        if self.stopping:
            return ShardStatus.STOPPED
        if self.draining and not self._complete():
            return ShardStatus.PENDING
        return ShardStatus.DONE

    def _drain(self) -> None:
        """Let the requests in flight finish until the drain is due (or the batch stops), then
        abort the rest and wait a moment for them to come back. A pause has no deadline of its
        own (a worker's drain that begins meanwhile brings its own)."""
        while self.in_flight and not self.stopping and not self.drain.time_up():
            self._collect(block_s=0.2)
            self._checkpoint()
            self._poll()
        if self.in_flight:
            logger.info(
                "shard %s attempt %s: the drain is due, %s requests in flight aborted",
                self.shard.id,
                self.attempt,
                self.in_flight,
            )
            self.host.abort_group(self.batch_id)
            deadline = time.monotonic() + ABORT_WAIT_S
            while self.in_flight and time.monotonic() < deadline:
                self._collect(block_s=0.2)

    def _spent(self) -> int:
        """The batch's tokens spent as far as this run knows: as last read, plus its own
        results since (committed or pending)."""
        pending = self.pending.input_tokens + self.pending.output_tokens
        return self.spent_read + self.spent_since + pending

    def _budget_admits(self, prompt: Any, params: Any) -> bool:
        """Whether a line may start under the batch's budget: no budget; or under it, with the
        line's worst case (prompt plus its output bound) fitting beside the worst cases of the
        lines in flight. A line that does not fit waits for those to end, then starts if
        anything is left (its output may be shorter than its bound). False: the budget is
        spent (or the run stops or pauses while it waits)."""
        if self.budget is None:
            return True
        cost = worst_case_tokens(prompt, params)
        while not (self.stopping or self.draining):
            spent = self._spent()
            if spent >= self.budget:
                return False
            if not self.in_flight or spent + sum(self.reserved.values()) + cost <= self.budget:
                return True
            self._collect(block_s=0.2)
            self._checkpoint()
            self._poll()
        return False

    def _budget_line(self, req: BatchRequest) -> dict[str, Any]:
        return error_record(
            req.custom_id,
            BUDGET_EXHAUSTED,
            f"This request was not run: the batch's token budget (max_total_tokens="
            f"{self.budget}) was spent ({self._spent()} prompt and output tokens) before it "
            f"could start. Retry it with a new budget (POST /v1/batches/{self.batch_id}/retry).",
            status_code=429,
            type="insufficient_quota",
        )

    def _complete(self) -> bool:
        """Whether every request of the shard has its line (committed, or pending the last
        checkpoint), though the worker drains."""
        return self.fed_all and not (
            self.in_flight or self.to_retry or self.suspects or self.dropped
        )

    def _feed(self) -> None:
        sto = storage()
        # A shard cut along prefix groups runs its own lines of its range, in their stored
        # order; any other its range, in the prefix plan's order of it.
        own = own_lines(sto, self.batch_id, self.shard, self.key)
        lines = shard_lines(sto, self.key, self.shard, own)
        order = own if own is not None else read_order(sto, self.batch_id, self.shard.index)
        for raw in in_run_order(lines, order, lambda raw: raw.line):
            if raw.line in self.done_lines:
                continue
            try:
                req = parse_request(
                    raw, endpoint=self.endpoint, served_models=None, forwarded=self.forwarded
                )
            except LineError as err:  # validated before; only a changed file lands here
                logger.error("shard %s line %s no longer parses: %s", self.shard.id, raw.line, err)
                self.pending.add_error(raw.line, unparsable_line_error(raw, err))
            else:
                prepared = self.handler.prepare(req)
                if isinstance(prepared, Line):
                    self.pending.add_error(req.line, prepared.record)
                elif self._budget_admits(*prepared):
                    self._submit(req, *prepared)
                elif not (self.stopping or self.draining):
                    self.pending.add_error(req.line, self._budget_line(req))
            self._collect()
            self._checkpoint()
            self._poll()
            if self.stopping or self.draining:
                return
        self.fed_all = True


BUDGET_EXHAUSTED = "budget_exhausted"


def worst_case_tokens(prompt: Any, params: Any) -> int:
    """The most tokens a prepared request may spend: its prompt's tokens (one prompt, or an
    embedding's several) plus its output bound (``max_tokens``, for generation). 0 for what
    cannot be counted here (an upstream's bodies)."""
    tokens = 0
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        tokens = sum(len(p) for p in prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:1]):
        tokens = len(prompt)
    return tokens + int(getattr(params, "max_tokens", 0) or 0)


def unparsable_line_error(raw: RawLine, err: LineError) -> dict[str, Any]:
    """The error line of an input line that passed validation but no longer parses when its
    shard reads it (the stored file changed): still one line per request, under the custom_id
    the line names if any can be read."""
    return error_record(
        custom_id_of(raw),
        err.code,
        f"This line no longer parses (the input file changed after validation): {err.message}",
        param=err.param,
    )
