"""``POST /v1/batches/estimate`` (a batchd extension): what a create with the same body would
make of its file, and when it would be done, without creating anything.

The control worker reads the file exactly as it validates a batch (every line checked, the
prompt tokens counted by the model's own tokenizer; ``worker.estimate``) and answers over the
broker (``core.rpc``); the times come from the work queued ahead of it and the throughput the
model's batches delivered recently (``core.eta_store``). Without any recent throughput the
times are null and ``reason`` says why: nothing is guessed.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from api.batch_checks import batch_input_file, checked_window_s
from api.deps import CurrentKey, SessionDep, SettingsDep
from api.errors import APIError
from api.routes.batches import _priority
from api.routes.common import error_responses
from api.schemas import BatchCreate, BatchErrorItem, BatchPriority, unix
from core import eta_store, rpc
from core.lifecycle import now
from core.queue import TASK_ESTIMATE
from core.settings import Settings

log = logging.getLogger("batchd.api")

router = APIRouter(prefix="/batches", tags=["batches"])


class ModelEstimate(BaseModel):
    requests: int
    prompt_tokens: int
    max_completion_tokens: int
    throughput_tokens_per_s: float | None = Field(
        default=None,
        description="Estimated tokens (prompt + output bound) per second the model's batches "
        "retired over the recent window; null when none ran.",
    )


class BatchEstimate(BaseModel):
    object: Literal["batch.estimate"] = "batch.estimate"
    endpoint: str
    completion_window: str
    priority: BatchPriority
    model: str | None = None
    total_requests: int
    valid_requests: int
    errors: list[BatchErrorItem] = Field(
        description="The line errors a create would fail with (the first 100, as validation "
        "reports them); empty when the file is valid."
    )
    prompt_tokens: int = Field(description="Exact, by the model's tokenizer.")
    max_completion_tokens: int = Field(description="The sum of the requests' output bounds.")
    per_model: dict[str, ModelEstimate]
    queue_ahead_tokens: int = Field(
        description="Estimated tokens that run before or beside this batch until it ends: "
        "higher priorities, this tenant's batches with earlier deadlines, and other tenants' "
        "fair share at the same priority."
    )
    estimated_start_at: int | None = None
    estimated_completion_at: int | None = None
    expires_at: int = Field(description="The deadline a batch created now would get.")
    fits_window: bool | None = Field(
        default=None, description="estimated_completion_at <= expires_at; null without times."
    )
    reason: str | None = Field(default=None, description="Why the times are null.")


@router.post(
    "/estimate",
    response_model=BatchEstimate,
    responses=error_responses(400, 403, 404, 500, 503),
    summary="Estimate a batch without creating it (batchd extension)",
)
def estimate_batch(
    body: BatchCreate, caller: CurrentKey, session: SessionDep, settings: SettingsDep
) -> BatchEstimate:
    priority = _priority(body, caller)
    seconds = checked_window_s(body.completion_window, caller, settings)
    input_file = batch_input_file(session, caller.tenant, body.input_file_id)
    key = input_file.storage_key
    session.commit()  # no connection held while the control worker reads the file
    scan = _scan(key, body.endpoint, settings)
    return build_estimate(session, settings, body, caller.tenant, priority, seconds, scan)


def _scan(key: str, endpoint: str, settings: Settings) -> dict[str, Any]:
    try:
        answer = rpc.call(TASK_ESTIMATE, key, endpoint, timeout=settings.estimate_timeout_s)
    except rpc.NoAnswer as error:
        raise APIError(
            503,
            f"No control worker read the file within {settings.estimate_timeout_s:g} seconds "
            "(estimate_timeout_s); the service may be busy or its control worker down. "
            "Retry shortly.",
            code="estimate_unavailable",
        ) from error
    except Exception as error:
        log.error("could not ask for an estimate: %s", error)
        raise APIError(
            503,
            "The task broker is unavailable; please retry shortly.",
            code="broker_unavailable",
        ) from error
    if not answer.get("ok"):
        raise APIError(500, f"The file could not be read: {answer.get('error')}")
    return answer


def build_estimate(
    session: Session,
    settings: Settings,
    body: BatchCreate,
    tenant: str,
    priority: str,
    window_s: int,
    scan: dict[str, Any],
) -> BatchEstimate:
    """The answer, from the control worker's scan and the queue as it is now."""
    created = now()
    deadline = created + timedelta(seconds=window_s)
    model = scan.get("model")
    valid = int(scan["valid_requests"])
    work = float(scan["est_tokens"])
    times = None
    reason = "The file holds no valid request: there is nothing to run."
    if model and valid:
        times = eta_store.times_for_new_batch(
            session,
            model,
            tenant=tenant,
            priority=priority,
            deadline=deadline.timestamp(),
            work=work,
            now=created,
            window_s=settings.throughput_window_s,
        )
        reason = times.reason
    projection = times.projection if times is not None else None
    per_model = {}
    if model and valid:
        per_model[model] = ModelEstimate(
            requests=valid,
            prompt_tokens=int(scan["prompt_tokens"]),
            max_completion_tokens=int(scan["max_completion_tokens"]),
            throughput_tokens_per_s=None if times is None else times.rate,
        )
    return BatchEstimate(
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        priority=priority,  # type: ignore[arg-type]
        model=model,
        total_requests=int(scan["total_requests"]),
        valid_requests=valid,
        errors=[BatchErrorItem(**e) for e in scan["errors"]],
        prompt_tokens=int(scan["prompt_tokens"]),
        max_completion_tokens=int(scan["max_completion_tokens"]),
        per_model=per_model,
        queue_ahead_tokens=0 if times is None else round(times.ahead.total),
        estimated_start_at=None if projection is None else int(projection.start),
        estimated_completion_at=None if projection is None else int(projection.finish),
        expires_at=unix(deadline) or 0,
        fits_window=None if projection is None else projection.finish <= deadline.timestamp(),
        reason=None if projection is not None else reason,
    )
