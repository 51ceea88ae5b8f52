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
from datetime import UTC
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from core import generation, metrics, served_models
from core.batchfile import BatchRequest, validate_file
from core.db import new_session, session_scope
from core.lifecycle import transition
from core.logs import log_context
from core.models import Batch, Shard
from core.queue import TASK_CANCEL, TASK_FINALIZE, TASK_SWEEP_EXPIRED, TASK_VALIDATE
from core.settings import get_settings
from core.sharding import ShardPlanner
from worker import runtime
from worker.celery_app import app
from worker.common import (
    input_key,
    live_shards,
    send,
    stale_after_s,
    storage,
    transient_error,
    utcnow,
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
        except Exception:
            prompt_len = 0
        self.prompt_tokens += prompt_len
        return generation.estimate_tokens(req, prompt_len, context)


# Statuses whose batches hold their prompt tokens against the tenant's enqueued-token limit
# (a batch still validating has not been counted yet, except the one being validated).
ENQUEUED_STATUSES = ("in_progress", "finalizing", "cancelling")


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
        Batch.tenant == tenant, Batch.model == model, Batch.status.in_(ENQUEUED_STATUSES)
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


def validate(batch_id: str) -> str | None:
    """Validate the batch's input file and plan its shards; return the new status."""
    settings = get_settings()
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            logger.warning("validate: batch %s is gone", batch_id)
            return None
        status, endpoint, tenant = batch.status, batch.endpoint, batch.tenant
        if status == "cancelling":
            return finalize(batch_id)
        if status != "validating":
            return None  # someone else got here first
        key = input_key(session, batch)

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

    session = new_session()
    try:
        if not report.ok:
            errors = report.error_dicts()
            if report.num_more_errors:
                errors.append(
                    {
                        "code": "too_many_errors",
                        "message": f"{report.num_more_errors} more errors were not reported "
                        f"(the first {len(report.errors)} are listed)",
                        "param": None,
                        "line": None,
                    }
                )
            won = transition(
                session,
                batch_id,
                "validating",
                "failed",
                errors=errors,
                request_total=report.num_requests + report.num_invalid,
            )
            session.commit()
            if won:
                notify(batch_id, "failed")
                return "failed"
        else:
            model = report.model or ""
            tokens = count.prompt_tokens
            limit = settings.max_enqueued_tokens_per_tenant
            _lock_tenant_model(session, tenant, model)
            used = enqueued_tokens(session, tenant, model, exclude=batch_id)
            if used + tokens > limit:
                won = transition(
                    session,
                    batch_id,
                    "validating",
                    "failed",
                    model=report.model,
                    est_prompt_tokens=tokens,
                    errors=[quota_error(tenant, model, limit, used, tokens)],
                    request_total=report.num_requests,
                )
                session.commit()
                if won:
                    metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
                    logger.info(
                        "batch %s: over the enqueued-token limit (%s + %s > %s)",
                        batch_id,
                        used,
                        tokens,
                        limit,
                    )
                    notify(batch_id, "failed")
                    return "failed"
                session.rollback()
                return finalize(batch_id)

            specs = planner.finish()
            shards = [
                Shard(
                    batch_id=batch_id,
                    index=spec.index,
                    status="pending",
                    start_line=spec.start_line,
                    end_line=spec.end_line,
                    start_offset=spec.start_offset,
                    end_offset=spec.end_offset,
                    num_requests=spec.num_requests,
                    est_tokens=spec.est_tokens,
                )
                for spec in specs
            ]
            won = transition(
                session,
                batch_id,
                "validating",
                "in_progress",
                model=report.model,
                request_total=report.num_requests,
                est_prompt_tokens=tokens,
            )
            if won:
                session.add_all(shards)
                session.commit()
                # The shards wait as pending rows; the release policy sends them (and the
                # release sweep does, should this fail).
                try:
                    release_for_model(model)
                except Exception:
                    logger.exception("batch %s: could not release its shards now", batch_id)
                logger.info(
                    "batch %s: %s requests in %s shards", batch_id, report.num_requests, len(shards)
                )
                return "in_progress"
            session.rollback()
    finally:
        session.close()
    # Lost the race: the batch was cancelled (or expired) while it was being validated.
    return finalize(batch_id)


def cancel(batch_id: str) -> str | None:
    """Finish a cancel now if no shard is running; otherwise the running shards notice within
    about a second, abort their requests and the last one to stop enqueues the finalize."""
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != "cancelling":
            return None
        running = live_shards(session, batch_id)
    if running:
        logger.info("batch %s: waiting for %s running shards to stop", batch_id, running)
        return None
    return finalize(batch_id)


def sweep_expired() -> int:
    """End batches past their completion window; also re-drive cancels whose shards died."""
    now = utcnow()
    with session_scope() as session:
        rows = session.execute(
            select(Batch.id, Batch.status, Batch.cancelling_at)
            .where(Batch.status.in_(("validating", "in_progress", "finalizing", "cancelling")))
            .where((Batch.expires_at <= now) | (Batch.status == "cancelling"))
        ).all()
    sent = 0
    for batch_id, status, cancelling_at in rows:
        if status == "cancelling" and cancelling_at is not None:
            if cancelling_at.tzinfo is None:
                cancelling_at = cancelling_at.replace(tzinfo=UTC)
            if (now - cancelling_at).total_seconds() < stale_after_s():
                continue
        send(TASK_FINALIZE, batch_id)
        sent += 1
    return sent


STEP_NAMES = {"validate": "Validating", "finalize": "Finalizing", "cancel": "Cancelling"}
# The statuses a control step that gave up moves to ``failed`` (a cancelling batch cannot fail:
# the expiry sweep re-drives its finalize).
GIVE_UP_FROM = {
    "validate": ("validating",),
    "finalize": ("validating", "in_progress", "finalizing"),
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
            session, batch_id, sources, "failed", errors=[task_failed_error(step, attempts, exc)]
        )
    if won:
        logger.error("batch %s failed: %s the batch failed %s times", batch_id, step, attempts)
        notify(batch_id, "failed")
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
