"""Validation streamed into execution: the validate task reads a batch's input once, in order,
and creates and releases each shard as soon as its lines are validated.

Policy (``core.batchfile`` documents the line rules; this module applies them to a batch):

* **The head.** The first shard's lines (up to ``shard_max_requests`` request lines, valid
  or not, or ``shard_max_tokens`` estimated tokens), or the whole file if it is smaller, are
  validated completely before anything is created. An error in the head fails the batch exactly as a
  whole-file validation did: the rest of the file is still read (parsed, not tokenised) so that
  ``errors.data`` lists the first ``max_errors_reported`` errors of the whole file, and no file
  is written. A file of one shard therefore behaves exactly as before.
* **Shards as they come.** Once the head is clean, shard 0 is created as a pending row in the
  transaction that moves the batch to ``in_progress``, and released at once. Each later shard
  is created (and released) as soon as the planner closes it. ``request_counts.total`` and
  ``est_prompt_tokens`` grow with each shard; ``validation_done`` stays False until the last
  shard is created (in the same transaction). While it is False nothing moves the batch to
  ``finalizing`` (``worker.shard_state.finish_if_last``), so it never completes on part of its
  plan, and its results are not shown (``GET /v1/batches/{id}/results``): a whole-file rule may
  still fail it.
* **A bad line after the head** (bad JSON, no or duplicate ``custom_id``, a bad parameter, the
  wrong url or model, a line too long, ...) no longer fails the batch. The line stays inside its
  shard's range and gets one line in the error file: its ``custom_id`` when it names one, its
  line number, the code and the message (:func:`core.batchfile.line_error_record`). These lines
  are written as the shard's first checkpoint chunk, committed with the shard row
  (``num_chunks`` 1, ``done_requests`` the number of bad lines) and logged in the results log,
  so the shard task skips them and the finalize merges them in line order like any result. A
  shard of bad lines only is created ``done``.
* **A whole-file rule broken after the head** — more than ``max_requests_per_batch`` request
  lines, or the tenant's enqueued-token limit (``max_enqueued_tokens_per_tenant``, counted
  shard by shard, in the transaction that creates it) — fails the batch: its unfinished shards
  are sealed (``closed``: no checkpoint can land any more, its running shards stop within a
  second), its results log is dropped with the chunks in storage, and it ends ``failed`` with
  ``errors.data`` naming the rule, the line and the limit, and no output or error file.
* **Cancel and expiry** may come at any time. Each shard is created under a lock on the batch
  row that re-checks its status and window, so a cancel or an expiry finalize sees a fixed set
  of shards; the finalize reports the lines never validated (after the last shard) as
  ``batch_cancelled``/``batch_expired`` lines, streaming the rest of the input
  (``worker.finalize``). Every request line thus ends as exactly one output or error line.
* **Crash safety.** Shard rows are the durable record of progress. A validate task that runs
  again (retried after an error, or re-sent by the reclaim sweep when ``validated_at`` has not
  moved for ``stuck_batch_after_s``: a killed worker's task would otherwise wait for the
  broker's visibility timeout) resumes after the last shard: it re-reads the lines before it
  once (parsed only, to rebuild the ``custom_id`` set, the model and the request count; never
  tokenised), plans on from that shard's end, and adds to the prompt tokens already committed
  on the batch row, so no line is planned twice and no token counted twice. Two runs at once
  are harmless: a shard is created only when it continues the last one, and a run that finds
  its shard already created moves on.

Cost: each line is parsed and tokenised once, as before; shards add one short transaction and
one release each.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Generator
from contextlib import suppress
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from celery.signals import worker_ready
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from core import generation, metrics, results_log, served_models
from core.batch_request import BatchRequest, LineError
from core.batchfile import (
    FILE_ERRORS,
    LineValidator,
    RawLine,
    ValidationReport,
    iter_lines,
    line_error_record,
)
from core.db import new_session
from core.lifecycle import ENQUEUED, BatchStatus, ShardStatus, now, transition
from core.models import Batch, Shard
from core.queue import CONTROL_QUEUE
from core.results_log import ChunkRecord, batch_log_prefix, log_chunk, write_chunk
from core.settings import get_settings
from core.sharding import ShardPlanner, ShardSpec
from worker import runtime
from worker.checkpoints import chunk_key
from worker.common import REQUEST_ERRORS, past_expiry, storage
from worker.prepared import write_prepared
from worker.release import release_for_model
from worker.shard_state import finish_if_last
from worker.webhooks import notify

logger = logging.getLogger(__name__)


class TokenCounter:
    """Estimates each request's tokens with the model's own tokenizer (no model weights), and
    sums the prompt tokens (what the batch holds against its tenant's enqueued-token limit);
    ``last_prompt`` is the prompt tokens of the request counted last."""

    def __init__(self, model_names: list[str]):
        self.model_names = set(model_names)
        self.prompt_tokens = 0
        self.last_prompt = 0
        self.last_ids: list[int] | None = None  # a generation request's prompt ids

    def __call__(self, req: BatchRequest) -> int:
        tok = runtime.tokenizer(req.model)
        context = runtime.context_length(req.model)
        self.last_ids = None
        try:
            ids = generation.prompt_token_ids(tok, req)
        except REQUEST_ERRORS as exc:
            # It fails with an error line when its shard runs; here it holds no tokens.
            logger.warning("line %s cannot be tokenized (%s); counted as 0 tokens", req.line, exc)
            ids = []
        else:
            if req.kind != "embedding":  # the embedding engine frames each input itself
                self.last_ids = ids
        prompt_len = len(ids)
        self.prompt_tokens += prompt_len
        self.last_prompt = prompt_len
        return generation.estimate_tokens(req, prompt_len, context)


def lock_tenant_model(session: Session, tenant: str, model: str) -> None:
    """Serialize quota checks of one tenant and model until this transaction ends, so two
    batches validated at once cannot both fit into the room for one (Postgres only; SQLite
    writers are serialized by the database)."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.sha256(f"batchd.quota:{tenant}:{model}".encode()).digest()
    session.execute(
        text("SELECT pg_advisory_xact_lock(:key)"),
        {"key": int.from_bytes(digest[:8], "big", signed=True)},
    )


def enqueued_tokens(session: Session, tenant: str, model: str, exclude: str | None = None) -> int:
    """Prompt tokens of ``tenant``'s unfinished batches on ``model``."""
    query = select(func.coalesce(func.sum(Batch.est_prompt_tokens), 0)).where(
        Batch.tenant == tenant, Batch.model == model, Batch.status.in_(ENQUEUED)
    )
    if exclude is not None:
        query = query.where(Batch.id != exclude)
    return int(session.scalar(query) or 0)


def quota_error(
    tenant: str, model: str, limit: int, used: int, tokens: int, line: int | None = None
) -> dict[str, Any]:
    """The ``errors`` entry of a batch over its tenant's enqueued-token limit; ``line`` is the
    line that took it over when that was found after the head."""
    through = f" through line {line}" if line is not None else ""
    return {
        "code": "token_limit_exceeded",
        "message": f"Enqueued token limit reached for {model} in tenant {tenant}: "
        f"limit {limit:,}, already enqueued {used:,}, this batch {tokens:,}{through}. "
        "Please try again once some of your batches have completed.",
        "param": None,
        "line": line,
    }


def too_many_errors(report: ValidationReport) -> dict[str, Any]:
    return {
        "code": "too_many_errors",
        "message": f"{report.num_more_errors} more errors were not reported "
        f"(the first {len(report.errors)} are listed)",
        "param": None,
        "line": None,
    }


def validation_errors(report: ValidationReport) -> list[dict[str, Any]]:
    """The ``errors.data`` of a batch whose file has errors: the first ones, then how many
    more were left out."""
    errors = report.error_dicts()
    if report.num_more_errors:
        errors.append(too_many_errors(report))
    return errors


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a validation resumes: after its last durable shard."""

    next_index: int
    line: int  # the first line after it
    offset: int  # and its byte offset


def progress(session: Session, batch_id: str) -> Progress | None:
    """The batch's validation progress, from its shard rows (None: no shard yet)."""
    last = session.execute(
        select(Shard.index, Shard.end_line, Shard.end_offset)
        .where(Shard.batch_id == batch_id)
        .order_by(Shard.index.desc())
        .limit(1)
    ).first()
    return None if last is None else Progress(last.index + 1, last.end_line, last.end_offset)


class Outcome(StrEnum):
    """How a validation run ended, when not with the batch ``in_progress`` or ``failed``."""

    STOPPED = "stopped"  # the batch was cancelled or expired meanwhile
    OVERTAKEN = "overtaken"  # another run of this validation got further


@dataclass(slots=True)
class _OpenShard:
    """What the open shard holds beside its range: the error lines of its bad lines, and the
    prompt tokens of each valid request (to name the line that crossed the token limit)."""

    errors: list[ChunkRecord] = field(default_factory=list)
    line_tokens: list[tuple[int, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    ids: list[tuple[int, list[int]]] = field(default_factory=list)  # see worker.prepared

    def add(self, line: int, prompt_tokens: int, ids: list[int] | None) -> None:
        self.line_tokens.append((line, prompt_tokens))
        self.prompt_tokens += prompt_tokens
        if ids is not None:
            self.ids.append((line, ids))


class _Failed(Exception):
    """The batch must fail with ``error`` (a whole-file rule broken after the head)."""

    def __init__(self, error: dict[str, Any], reason: str):
        super().__init__(error["message"])
        self.error = error
        self.reason = reason


class StreamedValidation:
    """One run of a batch's validation (see the module docstring); :meth:`run` returns the
    batch's status when it ends (``in_progress`` or ``failed``) or an :class:`Outcome`."""

    def __init__(
        self, batch_id: str, key: str, endpoint: str, tenant: str, resume: Progress | None
    ):
        settings = get_settings()
        self.settings = settings
        self.batch_id = batch_id
        self.key = key
        self.endpoint = endpoint
        self.tenant = tenant
        self.resume = resume
        served = [m for m, spec in settings.models.items() if served_models.serves(spec, endpoint)]
        self.lines = LineValidator(
            endpoint=endpoint,
            served_models=served,
            max_requests=settings.max_requests_per_batch,
            max_line_bytes=settings.max_line_bytes,
        )
        self.count = TokenCounter(served)
        self.planner = ShardPlanner(
            settings.shard_max_tokens,
            settings.shard_max_requests,
            first_index=resume.next_index if resume else 0,
            after_line=resume.line - 1 if resume else 0,
            after_offset=resume.offset if resume else 0,
        )
        self.open = _OpenShard()
        self.head = resume is None  # no shard exists yet
        self.report = ValidationReport()  # the head's errors

    # -- reading

    def _stream(self) -> Generator[RawLine]:
        sto = storage()
        max_line = self.settings.max_line_bytes
        if self.resume is None:
            with sto.reader(self.key) as stream:
                yield from iter_lines(stream, max_line_bytes=max_line)
            return
        chunks = sto.read_range(self.key, self.resume.offset, sto.size(self.key))
        yield from iter_lines(
            chunks,
            max_line_bytes=max_line,
            first_line=self.resume.line,
            base_offset=self.resume.offset,
        )

    def _replay(self) -> None:
        """Rebuild the file-wide state from the lines already in shards (after a crash):
        each parsed again, none tokenised."""
        if self.resume is None:
            return
        chunks = storage().read_range(self.key, 0, self.resume.offset)
        n = 0
        for raw in iter_lines(chunks, max_line_bytes=self.settings.max_line_bytes):
            n += 1
            with suppress(LineError):
                self.lines.check(raw)
        logger.info(
            "batch %s: validation resumes at line %s (shard %s) after re-reading %s lines",
            self.batch_id,
            self.resume.line,
            self.resume.next_index,
            n,
        )

    def run(self) -> str:
        if self.resume is not None:
            self._replay()
        lines = self._stream()
        try:
            for raw in lines:
                outcome = self._line(raw)
                if outcome is not None:
                    return outcome
            return self._end()
        except _Failed as failed:
            return self._fail_late(failed)
        finally:
            lines.close()

    def _line(self, raw: RawLine) -> str | None:
        if self.head and self.report.num_errors:
            return self._collect(raw)
        try:
            req = self.lines.check(raw)
        except LineError as err:
            if self.head and (err.code in FILE_ERRORS or not self._head_full()):
                return self._collect_error(err)
            if err.code in FILE_ERRORS:
                raise _Failed(err.to_dict(), err.code) from None
            closed = self.planner.add(raw.line, raw.offset, raw.length, 0)
            outcome = self._create(closed, last=False) if closed else None
            self.open.errors.append(ChunkRecord(raw.line, False, line_error_record(raw, err)))
            return outcome
        self.report.num_requests += 1
        tokens = self.count(req)
        closed = self.planner.add(req.line, req.offset, req.length, tokens)
        outcome = self._create(closed, last=False) if closed else None
        self.open.add(req.line, self.count.last_prompt, self.count.last_ids)
        return outcome

    def _head_full(self) -> bool:
        """The head holds ``shard_max_requests`` lines: the next line belongs to the next shard
        (closed by the planner when that line is added)."""
        return self.planner.open_requests >= self.planner.max_requests

    def _collect(self, raw: RawLine) -> str | None:
        """The head failed: go on reading only to report the file's errors, as a whole-file
        validation does."""
        try:
            self.lines.check(raw)
        except LineError as err:
            return self._collect_error(err)
        self.report.num_requests += 1
        return None

    def _collect_error(self, err: LineError) -> str | None:
        self.report.add_error(err, self.settings.max_errors_reported)
        if err.code == "too_many_requests":
            self.report.truncated = True
            return self._fail_invalid()
        self.report.num_invalid += 1
        return None

    def _end(self) -> str:
        if self.head and self.lines.request_lines == 0:
            self.report.add_error(
                LineError(None, "empty_file", "The file holds no requests"),
                self.settings.max_errors_reported,
            )
        if self.head and self.report.num_errors:
            return self._fail_invalid()
        if self.planner.open_requests:
            outcome = self._create(self.planner.finish()[-1], last=True)
            if outcome is not None:
                return outcome
        else:
            outcome = self._mark_done()
            if outcome is not None:
                return outcome
        # Its shards may all have ended while the last ones were planned.
        finish_if_last(self.batch_id)
        return BatchStatus.IN_PROGRESS

    # -- creating shards

    def _create(self, spec: ShardSpec, *, last: bool) -> str | None:
        """Create ``spec`` with the open shard's error lines and release it; None to go on."""
        shard, self.open = self.open, _OpenShard()
        if shard.ids:  # before the row: a shard that exists finds its ids stored
            write_prepared(storage(), self.batch_id, spec.index, shard.ids)
        outcome = self._commit(spec, shard, last)
        if outcome is not None:
            return outcome
        if spec.index == 0:
            logger.info("batch %s: in_progress with its first shard", self.batch_id)
            self.head = False
        try:
            release_for_model(self.lines.model)
        except Exception:
            logger.exception("batch %s: could not release its shards now", self.batch_id)
        return None

    def _commit(self, spec: ShardSpec, shard: _OpenShard, last: bool) -> str | None:
        session = new_session()
        try:
            row = session.execute(
                select(Batch.status, Batch.expires_at, Batch.est_prompt_tokens)
                .where(Batch.id == self.batch_id)
                .with_for_update()
            ).first()
            if (
                row is None
                or row.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
                or past_expiry(row.expires_at)
            ):
                return Outcome.STOPPED
            placed = self._placed(session, spec)
            if placed is not None:
                return placed or None  # "" (already created by an earlier try): go on
            tokens = int(row.est_prompt_tokens or 0) + shard.prompt_tokens
            over = self._over_quota(session, spec, shard, int(row.est_prompt_tokens or 0))
            if over is not None:
                session.rollback()
                if spec.index == 0:
                    return self._fail_over_quota(over, tokens, spec.num_requests)
                raise _Failed(over, "token_limit_exceeded")
            self._insert(session, spec, shard)
            values: dict[str, Any] = {
                "model": self.lines.model,
                "request_total": Batch.request_total + spec.num_requests,
                "request_failed": Batch.request_failed + len(shard.errors),
                "est_prompt_tokens": tokens,
                "validation_done": last,
                "validated_at": now(),
            }
            if row.status == BatchStatus.VALIDATING:
                transition(
                    session,
                    self.batch_id,
                    BatchStatus.VALIDATING,
                    BatchStatus.IN_PROGRESS,
                    **values,
                )
            else:
                session.execute(
                    update(Batch)
                    .where(Batch.id == self.batch_id)
                    .values(**values)
                    .execution_options(synchronize_session=False)
                )
            session.commit()
        finally:
            session.close()
        logger.info(
            "batch %s: shard %s created (lines %s-%s, %s requests, %s bad)%s",
            self.batch_id,
            spec.index,
            spec.start_line,
            spec.end_line - 1,
            spec.num_requests,
            len(shard.errors),
            "; validation done" if last else "",
        )
        return None

    def _placed(self, session: Session, spec: ShardSpec) -> str | None:
        """None if ``spec`` is the next shard to create; "" if an earlier try of this run (or
        another run) created it already; :attr:`Outcome.OVERTAKEN` if the shards so far do not
        lead to it (another run planned differently)."""
        last = progress(session, self.batch_id)
        next_index = last.next_index if last else 0
        if spec.index == next_index and (last is None or last.offset == spec.start_offset):
            return None
        same = session.execute(
            select(Shard.start_offset, Shard.end_offset).where(
                Shard.batch_id == self.batch_id, Shard.index == spec.index
            )
        ).first()
        if same is not None and tuple(same) == (spec.start_offset, spec.end_offset):
            return ""
        logger.warning(
            "batch %s: shard %s does not follow its shards so far; this validation stops",
            self.batch_id,
            spec.index,
        )
        return Outcome.OVERTAKEN

    def _over_quota(
        self, session: Session, spec: ShardSpec, shard: _OpenShard, before: int
    ) -> dict[str, Any] | None:
        """The quota error if the shard takes the batch over its tenant's enqueued-token
        limit (the tenant and model stay locked until the transaction ends)."""
        model = self.lines.model or ""
        limit = self.settings.max_enqueued_tokens_per_tenant
        lock_tenant_model(session, self.tenant, model)
        used = enqueued_tokens(session, self.tenant, model, exclude=self.batch_id)
        if used + before + shard.prompt_tokens <= limit:
            return None
        if spec.index == 0:
            return quota_error(self.tenant, model, limit, used, before + shard.prompt_tokens)
        total = before
        for line, tokens in shard.line_tokens:
            total += tokens
            if used + total > limit:
                return quota_error(self.tenant, model, limit, used, total, line)
        return quota_error(self.tenant, model, limit, used, total, spec.end_line - 1)

    def _insert(self, session: Session, spec: ShardSpec, shard: _OpenShard) -> None:
        """The shard's row, and its bad lines' error lines as its first (committed) chunk."""
        bad = len(shard.errors)
        session.add(
            Shard(
                batch_id=self.batch_id,
                index=spec.index,
                status=ShardStatus.DONE if bad == spec.num_requests else ShardStatus.PENDING,
                start_line=spec.start_line,
                end_line=spec.end_line,
                start_offset=spec.start_offset,
                end_offset=spec.end_offset,
                num_requests=spec.num_requests,
                est_tokens=spec.est_tokens,
                done_requests=bad,
                num_chunks=1 if bad else 0,
            )
        )
        session.flush()
        if bad:
            key = chunk_key(self.batch_id, spec.index, 0)
            log_chunk(session, self.batch_id, key, write_chunk(storage(), key, shard.errors))

    def _mark_done(self) -> str | None:
        """Every line is in a shard already (a run resumed at the end of the file)."""
        session = new_session()
        try:
            status = session.scalar(
                select(Batch.status).where(Batch.id == self.batch_id).with_for_update()
            )
            if status != BatchStatus.IN_PROGRESS:
                return Outcome.STOPPED
            session.execute(
                update(Batch)
                .where(Batch.id == self.batch_id)
                .values(validation_done=True, validated_at=now())
                .execution_options(synchronize_session=False)
            )
            session.commit()
        finally:
            session.close()
        return None

    # -- failing

    def _fail_invalid(self) -> str:
        """An error in the head: the batch fails with the file's errors (no shard exists)."""
        session = new_session()
        try:
            won = transition(
                session,
                self.batch_id,
                BatchStatus.VALIDATING,
                BatchStatus.FAILED,
                errors=validation_errors(self.report),
                request_total=self.report.num_requests + self.report.num_invalid,
            )
            session.commit()
        finally:
            session.close()
        if not won:
            return Outcome.STOPPED
        notify(self.batch_id, BatchStatus.FAILED)
        return BatchStatus.FAILED

    def _fail_over_quota(self, error: dict[str, Any], tokens: int, requests: int) -> str:
        """The head alone does not fit in the tenant's enqueued-token limit."""
        session = new_session()
        try:
            won = transition(
                session,
                self.batch_id,
                BatchStatus.VALIDATING,
                BatchStatus.FAILED,
                model=self.lines.model,
                est_prompt_tokens=tokens,
                errors=[error],
                request_total=requests,
            )
            session.commit()
        finally:
            session.close()
        if not won:
            return Outcome.STOPPED
        metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
        logger.info("batch %s: over the enqueued-token limit: %s", self.batch_id, error["message"])
        notify(self.batch_id, BatchStatus.FAILED)
        return BatchStatus.FAILED

    def _fail_late(self, failed: _Failed) -> str:
        if not fail_running(self.batch_id, failed.error):
            return Outcome.STOPPED
        if failed.reason == "token_limit_exceeded":
            metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
        logger.info("batch %s failed after its head: %s", self.batch_id, failed.error["message"])
        return BatchStatus.FAILED


def fail_running(batch_id: str, error: dict[str, Any]) -> bool:
    """Fail a batch whose validation is not done (in ``validating``, or ``in_progress`` with
    shards running): seal its unfinished shards, fail it with ``error``, drop its results log
    (nothing of it is ever shown), then delete the log's chunks, send its webhook event and let
    the release fill the slots it held. True if this call failed it.

    Shards are sealed before the batch row is locked, the order a checkpoint commit takes
    them in (``worker.shard_state.commit_chunk``)."""
    session = new_session()
    try:
        session.execute(
            update(Shard)
            .where(
                Shard.batch_id == batch_id,
                Shard.status.not_in((ShardStatus.DONE, ShardStatus.CLOSED)),
            )
            .values(status=ShardStatus.CLOSED)
            .execution_options(synchronize_session=False)
        )
        row = session.execute(
            select(Batch.status, Batch.validation_done, Batch.model)
            .where(Batch.id == batch_id)
            .with_for_update()
        ).first()
        running = row is not None and (
            row.status == BatchStatus.VALIDATING
            or (row.status == BatchStatus.IN_PROGRESS and not row.validation_done)
        )
        won = running and transition(
            session,
            batch_id,
            (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
            BatchStatus.FAILED,
            errors=[error],
            request_completed=0,
            request_failed=0,
        )
        if not won:
            session.rollback()
            return False
        model = row.model
        results_log.drop(session, [batch_id])
        session.commit()
    finally:
        session.close()
    try:
        storage().delete_prefix(batch_log_prefix(batch_id))
    except Exception:
        logger.exception("batch %s: results log forgotten, its chunks were not", batch_id)
    notify(batch_id, BatchStatus.FAILED)
    try:
        release_for_model(model)
    except Exception:
        logger.exception("batch %s: could not release the next shards of %s", batch_id, model)
    return True


@worker_ready.connect
def _load_tokenizers(sender: Any = None, **_: Any) -> None:
    """A control worker loads every served model's tokenizer (and context length) once, at
    start, in the background: a batch's first lines do not wait for it."""
    try:
        consumed = set(sender.app.amqp.queues.consume_from or ())
    except Exception:
        return
    if CONTROL_QUEUE not in consumed:
        return

    def load() -> None:
        loaded = []
        for model in get_settings().models:
            try:
                runtime.tokenizer(model)
                runtime.context_length(model)
                loaded.append(model)
            except Exception as exc:  # reported when a batch names the model
                logger.warning("could not load the tokenizer of %s yet: %s", model, exc)
        logger.info("tokenizers loaded for validation: %s", ", ".join(loaded) or "none")

    threading.Thread(target=load, name="batchd-tokenizer-loader", daemon=True).start()
