"""The shard task (model queues): run one contiguous range of a batch's requests through the
process-wide engine host and checkpoint the results.

Flow of :func:`run_shard`:

1. Re-read the shard and its batch. A batch that is no longer ``in_progress`` (cancelled,
   expiring) means: do nothing, but help it finalize if no shard is running any more.
2. Claim the shard: ``pending|running -> running``, ``attempts + 1``, while holding a share
   lock on the batch row, so a cancel either sees this shard running or the claim sees the
   cancel. ``attempts`` fences off any older attempt still alive: its commits stop matching.
3. Delete chunks an earlier attempt wrote but never committed; read the committed ones to
   learn which lines are done; skip those.
4. Feed the remaining requests to the engine host (``group = batch id``, so a cancel aborts
   the whole batch in one call; with the batch's tenant and priority, which the host's fair
   queue shares by). ``submit`` blocks while the batch already holds its window of pending
   requests in the host (``EngineHost.group_window``, one engine's worth of sequences, shared
   by all shards of the batch in this process), which bounds memory and keeps a bulk batch
   from queueing ahead of others; it is called with a short timeout so the loop keeps
   checkpointing and watching the batch status meanwhile.
5. Every ``checkpoint_every`` results or ``checkpoint_interval_s`` seconds: write a chunk
   (atomic), then in one transaction advance ``num_chunks``/``done_requests`` conditionally
   and add to the batch's live counters.
6. Done: mark the shard ``done``; the shard that finds no unfinished shard left moves the
   batch to ``finalizing`` (one conditional UPDATE: one winner) and enqueues the finalize.
   Cancelled or expired: abort the group, checkpoint what finished, mark the shard
   ``stopped``; the last one to stop enqueues the finalize.

Per-request failures (a prompt too long for the model, bad sampling values, an engine error
for that request) become error-file lines; they never fail the shard. A request whose engine
step failed is retried alone (see :class:`ShardRun`), up to ``max_request_attempts`` times.

Crash recovery: while an attempt runs, a background thread stamps ``heartbeat_at`` every
``heartbeat_interval_s``. A worker killed outright stops heartbeating; the reclaim sweep
(:mod:`worker.recovery`) re-queues its shard after ``shard_stale_after_s``, and the new
attempt resumes from the last committed checkpoint. A shard claimed more than
``max_shard_attempts`` times has its remaining requests reported as ``shard_failed`` error
lines. Every database step retries through a short database outage (``common.retrying``).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from celery.signals import worker_ready
from sqlalchemy import select, update

from core import generation
from core.batchfile import (
    EMBEDDINGS_URL,
    BatchRequest,
    LineError,
    iter_lines,
    parse_request,
)
from core.db import session_scope
from core.generation import error_for_exception, error_record
from core.lifecycle import transition
from core.models import Batch, Shard
from core.queue import TASK_FINALIZE, TASK_RUN_SHARD, model_queue
from core.results import GenerationResult, embedding_body, output_line
from core.settings import get_settings
from worker import runtime
from worker.celery_app import app
from worker.checkpoints import (
    ChunkRecord,
    chunk_key,
    committed_lines,
    discard_uncommitted,
    write_chunk,
)
from worker.common import (
    CLOSED,
    DONE,
    PENDING,
    RUNNING,
    STOPPED,
    heartbeat_interval_s,
    input_key,
    live_shards,
    past_expiry,
    release_next,
    retrying,
    send,
    stale_after_s,
    storage,
    unfinished_shards,
    utcnow,
)

logger = logging.getLogger(__name__)

STATUS_POLL_S = 1.0
SUBMIT_WAIT_S = 0.25
MAX_ABORT_RETRIES = 3  # a request aborted while its batch is still running is run again


ENGINE_PRIORITY = {"high": -1, "normal": 0, "low": 1}


class ShardLost(Exception):
    """Another attempt claimed this shard, or a finalize sealed it: stop without a trace."""


class EngineUnavailable(RuntimeError):
    """The engine host of this process is dead: the attempt fails and the shard is reclaimed
    (by a healthy worker) once its heartbeat goes stale."""


@dataclass
class ShardOutcome:
    status: str  # done | stopped | failed | skipped | lost
    ran: int = 0
    chunks: int = 0


@dataclass
class _Pending:
    """Finished results not yet checkpointed, each with its usage."""

    items: list[tuple[ChunkRecord, int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def records(self) -> list[ChunkRecord]:
        return [item[0] for item in self.items]

    @property
    def ok(self) -> int:
        return sum(1 for item in self.items if item[0].ok)

    @property
    def failed(self) -> int:
        return len(self.items) - self.ok

    @property
    def input_tokens(self) -> int:
        return sum(item[1] for item in self.items)

    @property
    def cached_tokens(self) -> int:
        return sum(item[2] for item in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(item[3] for item in self.items)

    def add_ok(self, line: int, record: dict[str, Any], result: GenerationResult) -> None:
        self.items.append(
            (
                ChunkRecord(line, True, record),
                result.prompt_tokens,
                result.cached_tokens,
                result.completion_tokens,
            )
        )

    def add_error(self, line: int, record: dict[str, Any]) -> None:
        self.items.append((ChunkRecord(line, False, record), 0, 0, 0))

    def take(self, n: int) -> _Pending:
        """Split off the first ``n`` results (in the order they finished)."""
        head = _Pending(self.items[:n])
        del self.items[:n]
        return head


# --------------------------------------------------------------------------------------------
# Database steps


def claim(shard_id: int, worker: str, *, force: bool = False) -> tuple[int, int] | None:
    """Claim the shard for a new attempt; (attempt, num_chunks), or None if it is not runnable.

    A ``pending`` shard is claimed; a ``running`` one only if its heartbeat is stale (its
    worker died), if ``worker`` already holds it (a retried claim whose first commit went
    through), or with ``force``. So a duplicate delivery of the task (late acknowledgement,
    a reclaim racing a redelivery) never takes a shard away from a live attempt."""

    def attempt() -> tuple[int, int] | None:
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            if shard is None:
                return None
            status = session.scalar(
                select(Batch.status).where(Batch.id == shard.batch_id).with_for_update(read=True)
            )
            if status != "in_progress":
                return None
            claimable = Shard.status == PENDING
            if force:
                claimable = Shard.status.in_((PENDING, RUNNING))
            else:
                cutoff = utcnow() - timedelta(seconds=stale_after_s())
                claimable = claimable | (
                    (Shard.status == RUNNING)
                    & (
                        Shard.heartbeat_at.is_(None)
                        | (Shard.heartbeat_at < cutoff)
                        | (Shard.worker == worker)
                    )
                )
            row = session.execute(
                update(Shard)
                .where(Shard.id == shard_id, claimable)
                .values(
                    status=RUNNING,
                    attempts=Shard.attempts + 1,
                    worker=worker,
                    heartbeat_at=utcnow(),
                )
                .returning(Shard.attempts, Shard.num_chunks)
                .execution_options(synchronize_session=False)
            ).first()
            return None if row is None else (row.attempts, row.num_chunks)

    return retrying(attempt, f"claiming shard {shard_id}")


def commit_chunk(shard: Shard, attempt: int, chunk: int, pending: _Pending) -> None:
    """Write chunk ``chunk`` and commit it with the live counters, or raise ShardLost.

    The shard row stays locked from the ownership check to the commit, so a newer attempt or
    a finalize sealing the shard waits for this chunk rather than racing it. Retried through
    a database outage; a retry that finds the chunk already committed (the connection died
    after the commit went through) counts it as done."""
    retrying(
        lambda: _commit_chunk_once(shard, attempt, chunk, pending),
        f"committing chunk {chunk} of shard {shard.id}",
    )


def _commit_chunk_once(shard: Shard, attempt: int, chunk: int, pending: _Pending) -> None:
    with session_scope() as session:
        row = session.execute(
            select(Shard.attempts, Shard.num_chunks, Shard.status)
            .where(Shard.id == shard.id)
            .with_for_update()
        ).first()
        if (
            row is not None
            and row.attempts == attempt
            and row.status == RUNNING
            and row.num_chunks == chunk + 1
        ):
            return  # an earlier try committed it; only its acknowledgement was lost
        if (
            row is None
            or row.attempts != attempt
            or row.status != RUNNING
            or row.num_chunks != chunk
        ):
            raise ShardLost(f"shard {shard.id} is no longer this attempt's ({row})")
        write_chunk(storage(), chunk_key(shard.batch_id, shard.index, chunk), pending.records)
        session.execute(
            update(Shard)
            .where(Shard.id == shard.id, Shard.num_chunks == chunk)
            .values(
                num_chunks=chunk + 1,
                done_requests=Shard.done_requests + len(pending),
                heartbeat_at=utcnow(),
            )
            .execution_options(synchronize_session=False)
        )
        session.execute(
            update(Batch)
            .where(Batch.id == shard.batch_id)
            .values(
                request_completed=Batch.request_completed + pending.ok,
                request_failed=Batch.request_failed + pending.failed,
                input_tokens=Batch.input_tokens + pending.input_tokens,
                cached_tokens=Batch.cached_tokens + pending.cached_tokens,
                output_tokens=Batch.output_tokens + pending.output_tokens,
            )
            .execution_options(synchronize_session=False)
        )


def set_shard_status(shard_id: int, attempt: int, status: str) -> bool:
    """End this attempt's shard as ``status``; False if the attempt no longer owns it.
    Idempotent, so a retry after a lost acknowledgement still reports success."""

    def attempt_once() -> bool:
        with session_scope() as session:
            result = session.execute(
                update(Shard)
                .where(
                    Shard.id == shard_id,
                    Shard.attempts == attempt,
                    Shard.status.in_((RUNNING, status)),
                )
                .values(status=status, heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            return result.rowcount == 1

    return retrying(attempt_once, f"ending shard {shard_id} as {status}")


def finish_if_last(batch_id: str) -> bool:
    """Move the batch to finalizing if no shard is unfinished; True for the one caller that
    wins. Callers commit their own shard's ``done`` first, so of two shards finishing at once
    at least the later one sees both done, and the conditional transition lets one win.

    If the connection dies while the transition commits, a retry cannot tell whether it won:
    it then sends the finalize anyway (a duplicate finalize is harmless; a lost one is not)."""
    tried = False

    def attempt() -> tuple[bool, bool]:
        nonlocal tried
        retry, tried = tried, True
        with session_scope() as session:
            if unfinished_shards(session, batch_id):
                return False, False
            if transition(session, batch_id, "in_progress", "finalizing"):
                return True, True
            status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
        return False, retry and status == "finalizing"

    won, resend = retrying(attempt, f"finishing batch {batch_id}")
    if won or resend:
        send(TASK_FINALIZE, batch_id)
    return won


def finalize_if_idle(batch_id: str) -> bool:
    """For a cancelling or expiring batch: enqueue the finalize once no shard is running."""

    def attempt() -> bool:
        with session_scope() as session:
            batch = session.get(Batch, batch_id)
            if batch is None:
                return False
            stopping = batch.status == "cancelling" or (
                batch.status in ("in_progress", "finalizing") and past_expiry(batch.expires_at)
            )
            return stopping and not live_shards(session, batch_id)

    if not retrying(attempt, f"checking batch {batch_id}"):
        return False
    send(TASK_FINALIZE, batch_id)
    return True


def _heartbeat(shard_id: int, attempt: int) -> bool:
    """Stamp the attempt's heartbeat; False if the attempt no longer owns the shard."""
    with session_scope() as session:
        result = session.execute(
            update(Shard)
            .where(Shard.id == shard_id, Shard.attempts == attempt, Shard.status == RUNNING)
            .values(heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1


def abandon(shard_id: int, attempt: int) -> None:
    """This attempt failed in-process: clear its heartbeat so the shard is reclaimable now."""

    def attempt_once() -> None:
        with session_scope() as session:
            session.execute(
                update(Shard)
                .where(Shard.id == shard_id, Shard.attempts == attempt, Shard.status == RUNNING)
                .values(heartbeat_at=None)
                .execution_options(synchronize_session=False)
            )

    try:
        retrying(attempt_once, f"abandoning shard {shard_id}", patience_s=10)
    except Exception:
        logger.exception("could not mark shard %s abandoned; the sweep will find it", shard_id)


class Heartbeat:
    """A background thread stamping one attempt's ``heartbeat_at`` every
    ``heartbeat_interval_s``, independent of how long engine steps or storage writes take.

    A database error is logged and the next beat tried (the shard goes stale only if the
    outage outlasts ``shard_stale_after_s``). If the row no longer matches the attempt (it
    was reclaimed, sealed by a finalize, or ended), :attr:`lost` is set and the thread ends.
    """

    def __init__(self, shard_id: int, attempt: int, interval_s: float | None = None):
        self.shard_id = shard_id
        self.attempt = attempt
        self.interval_s = interval_s if interval_s is not None else heartbeat_interval_s()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"batchd-heartbeat-{shard_id}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                owned = _heartbeat(self.shard_id, self.attempt)
            except Exception as exc:
                logger.warning("heartbeat of shard %s failed: %s", self.shard_id, exc)
                continue
            if not owned and not self._stop.is_set():
                self.lost.set()
                return


def _batch_stopping(batch_id: str) -> bool:
    def attempt() -> bool:
        with session_scope() as session:
            row = session.execute(
                select(Batch.status, Batch.expires_at).where(Batch.id == batch_id)
            ).first()
        return row is None or row.status != "in_progress" or past_expiry(row.expires_at)

    return retrying(attempt, f"reading batch {batch_id}")


# --------------------------------------------------------------------------------------------
# Engine output -> result lines


# --------------------------------------------------------------------------------------------
# The run


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
    """

    def __init__(
        self,
        shard: Shard,
        batch: Batch,
        key: str,
        attempt: int,
        num_chunks: int,
        done_lines: set[int],
        host: Any,
        after_commit: Callable[[int], None] | None = None,
    ):
        settings = get_settings()
        self.shard = shard
        self.batch_id = batch.id
        # The engine admits lower values first: a "high" batch overtakes the nightly bulk.
        self.priority = ENGINE_PRIORITY.get(batch.priority or "normal", 0)
        # Each tenant its own prefix cache (see Settings.share_prefix_cache_across_tenants).
        self.cache_salt = None if settings.share_prefix_cache_across_tenants else f"tenant:{batch.tenant}"
        self.tenant = batch.tenant  # the host shares each tier fairly across tenants
        self.endpoint = batch.endpoint
        self.model = batch.model or ""
        self.key = key
        self.attempt = attempt
        self.chunk = num_chunks
        self.done_lines = done_lines
        self.host = host
        self.tok = host.tokenizer
        # An embeddings batch runs on the model's embedding host (``runtime.host``): its
        # requests are prepared, submitted and turned into lines by the ``_*_embedding``
        # methods; everything else (checkpoints, cancel, retries) is the same.
        self.embedding = self.endpoint == EMBEDDINGS_URL
        self.context = 0 if self.embedding else runtime.context_length(self.model)
        self.vocab_size = len(self.tok)
        self.every = max(1, settings.checkpoint_every)
        self.interval = settings.checkpoint_interval_s
        self.max_request_attempts = max(1, settings.max_request_attempts)
        self.after_commit = after_commit
        self.done_q: queue.SimpleQueue[tuple[BatchRequest, list[int], Any, Future, bool]] = (
            queue.SimpleQueue()
        )
        self.pending = _Pending()
        self.in_flight = 0
        self.ran = 0
        self.stopping = False
        self.retries: dict[int, int] = {}
        self.to_retry: list[tuple[BatchRequest, list[int], Any]] = []
        self.refusals: dict[int, int] = {}  # RequestError count per line
        self.failures: dict[int, int] = {}  # failed engine steps while running alone, per line
        self.suspects: list[tuple[BatchRequest, list[int], Any]] = []
        self.suspect_line: int | None = None
        self.gate = runtime.isolation_gate(host)
        self.heartbeat: Heartbeat | None = None
        self._last_checkpoint = time.monotonic()
        self._last_poll = time.monotonic()

    # -- bookkeeping

    def _checkpoint(self, force: bool = False) -> None:
        """Commit full chunks of ``checkpoint_every`` results; a partial one when the interval
        has passed or ``force``."""
        while self.pending:
            n = len(self.pending)
            late = time.monotonic() - self._last_checkpoint >= self.interval
            if n < self.every and not (force or late):
                return
            chunk = self.pending.take(self.every)
            commit_chunk(self.shard, self.attempt, self.chunk, chunk)
            self.chunk += 1
            self.ran += len(chunk)
            self._last_checkpoint = time.monotonic()
            if self.after_commit is not None:
                self.after_commit(self.chunk)
        self._last_checkpoint = time.monotonic()

    def _poll(self, force: bool = False) -> None:
        if self.heartbeat is not None and self.heartbeat.lost.is_set():
            raise ShardLost(f"shard {self.shard.id} attempt {self.attempt} was reclaimed")
        now = time.monotonic()
        if force or now - self._last_poll >= STATUS_POLL_S:
            self._last_poll = now
            if not self.stopping and _batch_stopping(self.batch_id):
                logger.info(
                    "batch %s is stopping; shard %s aborts", self.batch_id, self.shard.index
                )
                self.stopping = True
                self.host.abort_group(self.batch_id)

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
        self, req: BatchRequest, ids: list[int], params: Any, future: Future, alone: bool
    ) -> None:
        from engine import RequestError
        from engine.host import HostError

        if self.embedding:
            self._handle_embedding(req, ids, params, future)
            return
        self.in_flight -= 1
        if alone:
            self.suspect_line = None
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, HostError):
                raise EngineUnavailable(str(exc)) from exc
            if isinstance(exc, RequestError):
                tries = self.refusals.get(req.line, 0) + 1
                self.refusals[req.line] = tries
                if tries < self.max_request_attempts:
                    self.to_retry.append((req, ids, params))
                else:
                    self.pending.add_error(req.line, error_for_exception(req, exc))
                return
            if isinstance(exc, ValueError):  # a parameter the engine cannot honour
                self.pending.add_error(req.line, error_for_exception(req, exc))
                return
            # A failed engine step (or another engine failure): this request may be the
            # culprit or a bystander; only a run alone tells.
            if alone:
                tries = self.failures.get(req.line, 0) + 1
                self.failures[req.line] = tries
                if tries >= self.max_request_attempts:
                    cause = exc.__cause__ or exc
                    logger.warning(
                        "shard %s line %s failed the engine %s times alone: %r",
                        self.shard.id,
                        req.line,
                        tries,
                        cause,
                    )
                    self.pending.add_error(
                        req.line,
                        error_record(
                            req.custom_id,
                            "server_error",
                            f"The engine failed on this request ({tries} attempts, the last "
                            f"ones run alone): {cause!r}",
                            status_code=500,
                            type="server_error",
                        ),
                    )
                    return
            self.suspects.append((req, ids, params))
            return
        output = future.result()
        if generation.is_aborted(output):
            # Aborted: part of a cancel or expiry (the finalize writes its error line), or,
            # if the batch is still running, something else aborted it: run it again.
            tries = self.retries.get(req.line, 0) + 1
            self.retries[req.line] = tries
            if tries <= MAX_ABORT_RETRIES:
                self.to_retry.append((req, ids, params))
            else:
                self.pending.add_error(req.line, generation.aborted_record(req))
            return
        record, result = generation.finished_record(self.tok, req, output)
        if result is None:
            self.pending.add_error(req.line, record)
        else:
            self.pending.add_ok(req.line, record, result)

    def _handle_embedding(self, req: BatchRequest, inputs: Any, dims: Any, future: Future) -> None:
        from engine.embedding_host import EmbeddingAborted, EmbeddingHostClosed

        self.in_flight -= 1
        exc = future.exception()
        if isinstance(exc, EmbeddingHostClosed):
            raise EngineUnavailable(str(exc)) from exc
        if exc is not None:
            # Aborted (a cancel, or something else: run it again), or its round failed.
            counts = self.retries if isinstance(exc, EmbeddingAborted) else self.failures
            limit = MAX_ABORT_RETRIES + 1 if isinstance(exc, EmbeddingAborted) else self.max_request_attempts
            tries = counts.get(req.line, 0) + 1
            counts[req.line] = tries
            if tries < limit:
                self.to_retry.append((req, inputs, dims))
            elif isinstance(exc, EmbeddingAborted):
                self.pending.add_error(req.line, generation.aborted_record(req))
            else:
                self.pending.add_error(req.line, error_for_exception(req, exc))
            return
        outputs = future.result()
        tokens = sum(o.num_tokens for o in outputs)
        body = embedding_body(req, [o.embedding for o in outputs], tokens)
        usage = GenerationResult(prompt_tokens=tokens, cached_tokens=0, choices=[])
        self.pending.add_ok(req.line, output_line(req.custom_id, body), usage)

    def _submit(self, req: BatchRequest, ids: list[int], params: Any, alone: bool = False) -> bool:
        """Hand one request to the host; False if the shard stopped first. Ordinary
        submissions wait while another shard isolates its suspects."""
        from engine.host import HostError

        def done(fut: Future, req: BatchRequest = req) -> None:
            self.done_q.put((req, ids, params, fut, alone))

        while not self.stopping:
            if not alone and self.gate.held_by_other(self):
                self._collect(block_s=0.05)
                self._checkpoint()
                self._poll()
                continue
            try:
                if self.embedding:
                    self.host.submit(
                        ids, dimensions=params, group=self.batch_id, timeout=SUBMIT_WAIT_S
                    ).add_done_callback(done)
                    self.in_flight += 1
                    return True
                self.host.submit(
                    ids,
                    params,
                    group=self.batch_id,
                    callback=done,
                    timeout=SUBMIT_WAIT_S,
                    priority=self.priority,
                    cache_salt=self.cache_salt,
                    tenant=self.tenant,
                )
            except TimeoutError:  # HostQueueFull, or the embedding host's full queue
                self._collect()
                self._checkpoint()
                self._poll()
                continue
            except HostError as exc:
                raise EngineUnavailable(str(exc)) from exc
            except ValueError as exc:  # refused at submission
                self.pending.add_error(req.line, error_for_exception(req, exc))
                return True
            self.in_flight += 1
            return True
        return False

    def _prepare(self, req: BatchRequest) -> tuple[Any, Any] | None:
        from engine import SamplingParams

        if self.embedding:
            return self._prepare_embedding(req)
        try:
            ids, kwargs = generation.prepare_request(self.tok, req, self.context, self.vocab_size)
            params = SamplingParams(**kwargs)
        except Exception as exc:
            self.pending.add_error(req.line, error_for_exception(req, exc))
            return None
        return ids, params

    def _prepare_embedding(self, req: BatchRequest) -> tuple[list[list[int]], int] | None:
        """The inputs as the model's token ids and the output size, or the request's error
        line (an input over the model's length, a token outside its vocabulary, a size it
        cannot cut to), naming the field."""
        from engine.embedding import EmbeddingError

        engine = self.host.engine
        single = not isinstance(req.body.get("input"), list) or not isinstance(
            req.body["input"][0], str | list
        )
        try:
            dims = engine.check_dimensions(req.dimensions)
            inputs = [engine.token_ids(item, i) for i, item in enumerate(req.inputs or ())]
        except EmbeddingError as exc:
            param, message = f"body.{exc.param}", str(exc)
            if exc.param.startswith("input") and single:  # one input: no index to name
                param, message = "body.input", message.replace("input[0]", "input", 1)
            self.pending.add_error(
                req.line, error_record(req.custom_id, exc.code, message, param=param)
            )
            return None
        return inputs, dims

    def _host_idle(self) -> bool:
        try:
            stats = self.host.stats(timeout=10)
        except Exception:
            return False
        return stats.pending + stats.in_flight == 0

    def _advance_suspects(self) -> None:
        """Run the next suspect alone once the engine has drained (see the class docstring)."""
        if self.stopping or self.suspect_line is not None:
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

    # -- the loop

    def run(self) -> str:
        """Return ``done`` or ``stopped``; raise ShardLost if this attempt lost the shard."""
        self.heartbeat = Heartbeat(self.shard.id, self.attempt).start()
        try:
            self._feed()
            while not self.stopping and (self.in_flight or self.to_retry or self.suspects):
                if self.to_retry:
                    self._poll(force=True)  # was the abort a cancel this shard has not seen?
                    if self.stopping:
                        break
                retry, self.to_retry = self.to_retry, []
                for req, ids, params in retry:
                    self._submit(req, ids, params)
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
            self._checkpoint(force=True)
        except ShardLost:
            if self.stopping:
                self.host.abort_group(self.batch_id)
            raise
        finally:
            self.gate.release(self)
            self.heartbeat.stop()
        return STOPPED if self.stopping else DONE

    def _feed(self) -> None:
        sto = storage()
        chunks = sto.read_range(self.key, self.shard.start_offset, self.shard.end_offset)
        for raw in iter_lines(
            chunks,
            max_line_bytes=get_settings().max_line_bytes,
            first_line=self.shard.start_line,
            base_offset=self.shard.start_offset,
        ):
            if raw.line in self.done_lines:
                continue
            try:
                req = parse_request(raw, endpoint=self.endpoint, served_models=None)
            except LineError as err:  # validated before; only a changed file lands here
                logger.error("shard %s line %s no longer parses: %s", self.shard.id, raw.line, err)
                continue
            prepared = self._prepare(req)
            if prepared is not None:
                self._submit(req, *prepared)
            self._collect()
            self._checkpoint()
            self._poll()
            if self.stopping:
                return


def _load(shard_id: int) -> tuple[Shard, Batch, str] | None:
    def attempt() -> tuple[Shard, Batch, str] | None:
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            batch = session.get(Batch, shard.batch_id) if shard is not None else None
            if shard is None or batch is None:
                return None
            key = input_key(session, batch)
            session.expunge_all()
        return shard, batch, key

    return retrying(attempt, f"reading shard {shard_id}")


def run_shard(
    shard_id: int,
    *,
    worker: str | None = None,
    host: Any = None,
    after_commit: Callable[[int], None] | None = None,
) -> ShardOutcome:
    """Run (or resume) one shard; see the module docstring. ``host`` defaults to the
    process-wide engine host for the batch's model."""
    worker = worker or f"{socket.gethostname()}:{threading.get_ident()}"
    worker = f"{worker}:{uuid.uuid4().hex[:8]}"  # one token per attempt (see claim)
    loaded = _load(shard_id)
    if loaded is None:
        logger.warning("shard %s is gone", shard_id)
        return ShardOutcome("skipped")
    shard, batch, key = loaded
    if (
        shard.status in (DONE, CLOSED, STOPPED)
        or batch.status != "in_progress"
        or past_expiry(batch.expires_at)
    ):
        if shard.status == DONE and batch.status == "in_progress":
            finish_if_last(batch.id)  # a redelivered task of a finished shard
        else:
            finalize_if_idle(batch.id)
        release_next(batch.model)
        return ShardOutcome("skipped")

    claimed = claim(shard_id, worker)
    if claimed is None:
        finalize_if_idle(batch.id)
        return ShardOutcome("skipped")
    attempt, num_chunks = claimed
    max_attempts = get_settings().max_shard_attempts
    if attempt > max_attempts:
        from worker.recovery import fail_claimed

        fail_claimed(
            shard_id,
            attempt,
            num_chunks,
            f"The shard holding this request failed {attempt - 1} times "
            f"(max_shard_attempts={max_attempts}); its unfinished requests are reported as "
            "errors",
        )
        return ShardOutcome("failed")
    sto = storage()
    discarded = discard_uncommitted(sto, batch.id, shard.index, num_chunks)
    done_lines = committed_lines(sto, batch.id, shard.index, num_chunks)
    if discarded or done_lines:
        logger.info(
            "shard %s attempt %s resumes: %s lines done, %s uncommitted chunks discarded",
            shard_id,
            attempt,
            len(done_lines),
            discarded,
        )
    if host is None:
        host = runtime.host(batch.model or "")
    run = ShardRun(shard, batch, key, attempt, num_chunks, done_lines, host, after_commit)
    try:
        status = run.run()
    except ShardLost as lost:
        logger.warning("shard %s attempt %s stops: %s", shard_id, attempt, lost)
        return ShardOutcome("lost", run.ran, run.chunk)
    except BaseException:
        # Leave the shard running but mark it abandoned (no heartbeat): a redelivered task
        # may claim it at once, the reclaim sweep re-queues it on its next pass, and a cancel
        # does not wait for it. Either resumes from the last committed checkpoint.
        logger.exception("shard %s attempt %s failed", shard_id, attempt)
        abandon(shard_id, attempt)
        raise
    if not set_shard_status(shard_id, attempt, status):
        return ShardOutcome("lost", run.ran, run.chunk)
    if status == DONE:
        finish_if_last(batch.id)
    else:
        finalize_if_idle(batch.id)
    release_next(batch.model)
    return ShardOutcome(status, run.ran, run.chunk)


@app.task(name=TASK_RUN_SHARD, bind=True)
def run_shard_task(self: Any, shard_id: int) -> None:
    run_shard(int(shard_id), worker=f"{self.request.hostname}:{threading.get_ident()}")


def send_shards(model: str, shard_ids: list[int]) -> None:
    for shard_id in shard_ids:
        send(TASK_RUN_SHARD, shard_id, queue=model_queue(model))


@worker_ready.connect
def _load_served_models(sender: Any = None, **_: Any) -> None:
    """Load the engine of every model whose queue this worker consumes, once, at start."""
    try:
        consumed = set(sender.app.amqp.queues.consume_from or ())
    except Exception:
        return
    models = [m for m in get_settings().models if model_queue(m) in consumed]
    if not models:
        return

    def load() -> None:
        for model in models:
            try:
                runtime.host(model)
            except Exception:
                logger.exception("could not load model %s", model)

    threading.Thread(target=load, name="batchd-model-loader", daemon=True).start()
