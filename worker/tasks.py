"""Control-queue tasks: validate, finalize, cancel and the expiry sweep.

Every task re-reads the batch and acts only if the world still calls for it, so a duplicate
delivery (late acknowledgement) or a race with another actor is harmless: each status change is
one conditional UPDATE (:func:`core.lifecycle.transition`) and only one actor wins it.

No failure may strand a batch: a validate, finalize or cancel that raises is retried with
backoff and, past ``control_task_max_attempts`` runs, the batch fails with the error named in
its ``errors`` (:func:`run_control_step`); a task that was lost is sent again by the sweeps.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from core import generation, metrics, served_models
from core.batchfile import BatchRequest, ValidationReport, validate_file
from core.db import new_session, session_scope
from core.lifecycle import ENQUEUED, UNFINISHED, BatchStatus, ShardStatus, now, transition
from core.logs import log_context
from core.models import Batch, Shard
from core.queue import TASK_CANCEL, TASK_FINALIZE, TASK_SWEEP_EXPIRED, TASK_VALIDATE
from core.settings import get_settings
from core.sharding import ShardPlanner
from worker import runtime
from worker.celery_app import app
from worker.common import (
    REQUEST_ERRORS,
    input_key,
    live_shards,
    send,
    stale_after_s,
    storage,
    transient_error,
)
from worker.finalize import finalize
from worker.release import release_for_model
from worker.webhooks import notify

logger = logging.getLogger(__name__)


class _TokenCounter:
    """Estimates each request's tokens with the model's own tokenizer (no model weights), and
    sums the prompt tokens (what the batch holds against its tenant's enqueued-token limit)."""

    def __init__(self, model_names: list[str]):
        self.model_names = set(model_names)
        self.prompt_tokens = 0

    def __call__(self, req: BatchRequest) -> int:
        tok = runtime.tokenizer(req.model)
        context = runtime.context_length(req.model)
        try:
            prompt_len = len(generation.prompt_token_ids(tok, req))
        except REQUEST_ERRORS as exc:
            # It fails with an error line when its shard runs; here it holds no tokens.
            logger.warning("line %s cannot be tokenized (%s); counted as 0 tokens", req.line, exc)
            prompt_len = 0
        self.prompt_tokens += prompt_len
        return generation.estimate_tokens(req, prompt_len, context)


def _lock_tenant_model(session: Session, tenant: str, model: str) -> None:
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


def quota_error(tenant: str, model: str, limit: int, used: int, tokens: int) -> dict[str, Any]:
    return {
        "code": "token_limit_exceeded",
        "message": f"Enqueued token limit reached for {model} in tenant {tenant}: "
        f"limit {limit:,}, already enqueued {used:,}, this batch {tokens:,}. "
        "Please try again once some of your batches have completed.",
        "param": None,
        "line": None,
    }


@dataclass(slots=True)
class _Scan:
    """A validated input file: the report, the shards planned and the prompt tokens counted."""

    report: ValidationReport
    planner: ShardPlanner
    prompt_tokens: int


def scan_input(key: str, endpoint: str) -> _Scan:
    """Stream the input file once: validate every line, count its tokens, plan the shards."""
    settings = get_settings()
    served = [m for m, spec in settings.models.items() if served_models.serves(spec, endpoint)]
    planner = ShardPlanner(settings.shard_max_tokens, settings.shard_max_requests)
    count = _TokenCounter(served)

    def on_request(req: BatchRequest) -> None:
        planner.add(req.line, req.offset, req.length, count(req))

    with storage().reader(key) as stream:
        report = validate_file(
            stream,
            endpoint=endpoint,
            served_models=served,
            max_requests=settings.max_requests_per_batch,
            max_line_bytes=settings.max_line_bytes,
            max_errors=settings.max_errors_reported,
            on_request=on_request,
        )
    return _Scan(report, planner, count.prompt_tokens)


def _too_many_errors(report: ValidationReport) -> dict[str, Any]:
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
        errors.append(_too_many_errors(report))
    return errors


def _fail_invalid(session: Session, batch_id: str, report: ValidationReport) -> bool:
    """The input file has errors: the batch fails with them; True if this call failed it."""
    errors = validation_errors(report)
    won = transition(
        session,
        batch_id,
        BatchStatus.VALIDATING,
        BatchStatus.FAILED,
        errors=errors,
        request_total=report.num_requests + report.num_invalid,
    )
    session.commit()
    return won


def _fail_over_quota(session: Session, batch_id: str, tenant: str, scan: _Scan) -> bool | None:
    """Fail the batch if it does not fit in its tenant's enqueued-token limit: True if this
    call failed it, False if another actor moved it first, None if it fits (the tenant and
    model stay locked until the transaction ends)."""
    model = scan.report.model or ""
    tokens = scan.prompt_tokens
    limit = get_settings().max_enqueued_tokens_per_tenant
    _lock_tenant_model(session, tenant, model)
    used = enqueued_tokens(session, tenant, model, exclude=batch_id)
    if used + tokens <= limit:
        return None
    won = transition(
        session,
        batch_id,
        BatchStatus.VALIDATING,
        BatchStatus.FAILED,
        model=scan.report.model,
        est_prompt_tokens=tokens,
        errors=[quota_error(tenant, model, limit, used, tokens)],
        request_total=scan.report.num_requests,
    )
    session.commit()
    if won:
        metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
        logger.info(
            "batch %s: over the enqueued-token limit (%s + %s > %s)", batch_id, used, tokens, limit
        )
    return won


def _start(session: Session, batch_id: str, scan: _Scan) -> bool:
    """Move the batch to ``in_progress`` with its shards as pending rows; True if this call
    won (the caller commits nothing: this commits or rolls back)."""
    shards = [
        Shard(
            batch_id=batch_id,
            index=spec.index,
            status=ShardStatus.PENDING,
            start_line=spec.start_line,
            end_line=spec.end_line,
            start_offset=spec.start_offset,
            end_offset=spec.end_offset,
            num_requests=spec.num_requests,
            est_tokens=spec.est_tokens,
        )
        for spec in scan.planner.finish()
    ]
    won = transition(
        session,
        batch_id,
        BatchStatus.VALIDATING,
        BatchStatus.IN_PROGRESS,
        model=scan.report.model,
        request_total=scan.report.num_requests,
        est_prompt_tokens=scan.prompt_tokens,
    )
    if not won:
        session.rollback()
        return False
    session.add_all(shards)
    session.commit()
    logger.info(
        "batch %s: %s requests in %s shards", batch_id, scan.report.num_requests, len(shards)
    )
    return True


def validate(batch_id: str) -> str | None:
    """Validate the batch's input file and plan its shards; return the new status."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            logger.warning("validate: batch %s is gone", batch_id)
            return None
        status, endpoint, tenant = batch.status, batch.endpoint, batch.tenant
        if status == BatchStatus.CANCELLING:
            return finalize(batch_id)
        if status != BatchStatus.VALIDATING:
            return None  # someone else got here first
        key = input_key(session, batch)

    scan = scan_input(key, endpoint)
    session = new_session()
    try:
        if not scan.report.ok:
            won = _fail_invalid(session, batch_id, scan.report)
        else:
            won = _fail_over_quota(session, batch_id, tenant, scan)
            if won is None and _start(session, batch_id, scan):
                # The shards wait as pending rows; the release policy sends them (and the
                # release sweep does, should this fail).
                try:
                    release_for_model(scan.report.model or "")
                except Exception:
                    logger.exception("batch %s: could not release its shards now", batch_id)
                return BatchStatus.IN_PROGRESS
    finally:
        session.close()
    if won:
        notify(batch_id, BatchStatus.FAILED)
        return BatchStatus.FAILED
    # Lost the race: the batch was cancelled (or expired) while it was being validated.
    return finalize(batch_id)


def cancel(batch_id: str) -> str | None:
    """Finish a cancel now if no shard is running; otherwise the running shards notice within
    about a second, abort their requests and the last one to stop enqueues the finalize."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.CANCELLING:
            return None
        running = live_shards(session, batch_id)
    if running:
        logger.info("batch %s: waiting for %s running shards to stop", batch_id, running)
        return None
    return finalize(batch_id)


def sweep_expired() -> int:
    """End batches past their completion window; also re-drive cancels whose shards died."""
    current = now()
    with session_scope() as session:
        rows = session.execute(
            select(Batch.id, Batch.status, Batch.cancelling_at)
            .where(Batch.status.in_(UNFINISHED))
            .where((Batch.expires_at <= current) | (Batch.status == BatchStatus.CANCELLING))
        ).all()
    sent = 0
    for batch_id, status, cancelling_at in rows:
        recent = cancelling_at is not None and (current - cancelling_at).total_seconds() < (
            stale_after_s()
        )
        if status == BatchStatus.CANCELLING and recent:
            continue
        send(TASK_FINALIZE, batch_id)
        sent += 1
    return sent


STEP_NAMES = {"validate": "Validating", "finalize": "Finalizing", "cancel": "Cancelling"}
# The statuses a control step that gave up moves to ``failed`` (a cancelling batch cannot fail:
# the expiry sweep re-drives its finalize).
GIVE_UP_FROM = {
    "validate": (BatchStatus.VALIDATING,),
    "finalize": (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING),
    "cancel": (),
}


def retry_delay_s(attempt: int) -> float:
    """The wait before run ``attempt + 1`` of a control task: doubling, at most a minute,
    with jitter so batches that failed together do not retry in lockstep."""
    base = get_settings().control_task_retry_delay_s * 2 ** (attempt - 1)
    return min(60.0, base) * (0.75 + random.random() / 2)


def _describe(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def task_failed_error(step: str, attempts: int, exc: BaseException) -> dict[str, Any]:
    """The ``errors`` entry of a batch whose control step kept raising."""
    return {
        "code": "server_error",
        "message": f"{STEP_NAMES[step]} the batch failed {attempts} times; the last error was "
        f"{_describe(exc)}. Please create the batch again.",
        "param": None,
        "line": None,
    }


def give_up(batch_id: str, step: str, attempts: int, exc: BaseException) -> bool:
    """Fail the batch of a control step that kept raising; True if this call failed it."""
    sources = GIVE_UP_FROM[step]
    if not sources:
        return False
    with session_scope() as session:
        won = transition(
            session,
            batch_id,
            sources,
            BatchStatus.FAILED,
            errors=[task_failed_error(step, attempts, exc)],
        )
    if won:
        logger.error("batch %s failed: %s the batch failed %s times", batch_id, step, attempts)
        notify(batch_id, BatchStatus.FAILED)
    return won


def run_control_step(task: Any, step: str, batch_id: str) -> None:
    """Run ``step`` (validate, finalize or cancel) of ``batch_id`` for the bound Celery
    ``task``. If it raises, the task is retried with backoff, up to
    ``control_task_max_attempts`` runs; then the batch fails with the error named (see
    :func:`give_up`), unless the last error was a database or broker outage: the batch then
    stays as it is and the sweeps send its task again (a batch stuck validating or finalizing:
    the reclaim sweep; one past its window or cancelling: the expiry sweep)."""
    steps = {"validate": validate, "finalize": finalize, "cancel": cancel}
    try:
        steps[step](batch_id)
        return
    except Exception as exc:
        settings = get_settings()
        attempt = task.request.retries + 1
        if attempt < settings.control_task_max_attempts:
            delay = retry_delay_s(attempt)
            logger.warning(
                "%s batch %s failed (run %s of %s): %s; retrying in %.1fs",
                step,
                batch_id,
                attempt,
                settings.control_task_max_attempts,
                _describe(exc),
                delay,
                exc_info=True,
            )
            raise task.retry(exc=exc, countdown=delay) from exc
        if transient_error(exc):
            logger.error(
                "%s batch %s failed %s times (%s); the sweeps send it again",
                step,
                batch_id,
                attempt,
                _describe(exc),
            )
            raise
        logger.exception("%s batch %s failed %s times; giving up", step, batch_id, attempt)
        give_up(batch_id, step, attempt, exc)


@app.task(name=TASK_VALIDATE, bind=True, max_retries=None)
def validate_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "validate", batch_id)


@app.task(name=TASK_FINALIZE, bind=True, max_retries=None)
def finalize_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "finalize", batch_id)


@app.task(name=TASK_CANCEL, bind=True, max_retries=None)
def cancel_batch(self: Any, batch_id: str) -> None:
    with log_context(batch_id=batch_id):
        run_control_step(self, "cancel", batch_id)


@app.task(name=TASK_SWEEP_EXPIRED)
def sweep_expired_task(**_: Any) -> None:
    sweep_expired()
