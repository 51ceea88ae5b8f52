"""``/v1/batches``: create (then enqueue validation), retrieve, list, cancel."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from api.deps import CurrentKey, SessionDep, SettingsDep
from api.errors import APIError, invalid_request, not_found
from api.routes.common import error_responses
from api.routes.files import get_file_row
from api.schemas import BatchCreate, BatchList, BatchPublic, window_seconds
from core.ids import batch_id
from core.lifecycle import TERMINAL, now, transition
from core.models import Batch
from core.queue import TASK_CANCEL, TASK_VALIDATE, enqueue

log = logging.getLogger("batchd.api")

router = APIRouter(prefix="/batches", tags=["batches"])

CANCELLABLE = ("validating", "in_progress")
BROKER_UNAVAILABLE = "The task broker is unavailable; please retry shortly."


def get_batch_row(session: Session, tenant: str, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id)
    if row is None or row.tenant != tenant:
        raise not_found("Batch", batch_id)
    return row


@router.post(
    "", response_model=BatchPublic, responses=error_responses(400, 404), summary="Create a batch"
)
def create_batch(
    body: BatchCreate, caller: CurrentKey, session: SessionDep, settings: SettingsDep
) -> BatchPublic:
    seconds = window_seconds(body.completion_window) or 0
    if seconds > settings.max_completion_window_s:
        raise invalid_request(
            f"Invalid value for 'completion_window': {body.completion_window} is longer than "
            f"the maximum of {settings.max_completion_window_s} seconds.",
            param="completion_window",
        )
    input_file = get_file_row(session, caller.tenant, body.input_file_id, param="input_file_id")
    if input_file.purpose != "batch":
        raise invalid_request(
            f"The input file {input_file.id} has purpose '{input_file.purpose}'; "
            "a batch needs a file uploaded with purpose 'batch'.",
            param="input_file_id",
        )
    created = now()
    row = Batch(
        id=batch_id(),
        tenant=caller.tenant,
        endpoint=body.endpoint,
        input_file_id=input_file.id,
        completion_window=body.completion_window,
        status="validating",
        metadata_=body.metadata,
        created_at=created,
        expires_at=created + timedelta(seconds=seconds),
        request_total=0,
        request_completed=0,
        request_failed=0,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
    )
    session.add(row)
    session.commit()
    try:
        enqueue(TASK_VALIDATE, row.id)
    except Exception as error:
        log.error("could not enqueue validation of %s: %s", row.id, error)
        transition(
            session,
            row.id,
            "validating",
            "failed",
            errors=[{"code": "broker_unavailable", "message": BROKER_UNAVAILABLE, "param": None, "line": None}],
        )
        session.commit()
        raise APIError(
            503,
            f"{BROKER_UNAVAILABLE} Batch {row.id} was not started and has been marked failed.",
            code="broker_unavailable",
        ) from error
    return BatchPublic.of(row)


@router.get(
    "/{batch_id}", response_model=BatchPublic, responses=error_responses(404), summary="Retrieve a batch"
)
def retrieve_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    return BatchPublic.of(get_batch_row(session, caller.tenant, batch_id))


@router.get("", response_model=BatchList, responses=error_responses(400), summary="List batches")
def list_batches(
    caller: CurrentKey,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    query = select(Batch).where(Batch.tenant == caller.tenant)
    if after is not None:
        cursor = session.get(Batch, after)
        if cursor is None or cursor.tenant != caller.tenant:
            raise invalid_request(f"No such Batch object for 'after': {after}", param="after")
        query = query.where(
            or_(
                Batch.created_at < cursor.created_at,
                and_(Batch.created_at == cursor.created_at, Batch.id < cursor.id),
            )
        )
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    data = [BatchPublic.of(row) for row in rows[:limit]]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(rows) > limit,
    )


@router.post(
    "/{batch_id}/cancel",
    response_model=BatchPublic,
    responses=error_responses(404, 409),
    summary="Cancel a batch",
)
def cancel_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    row = get_batch_row(session, caller.tenant, batch_id)
    for _ in range(3):  # the status may move under us; re-read and decide again
        if row.status == "cancelling":
            return BatchPublic.of(row)
        if row.status not in CANCELLABLE:
            raise APIError(
                409,
                f"Cannot cancel batch {batch_id}: its status is '{row.status}'"
                + (" (already finished)." if row.status in TERMINAL else "."),
                code="batch_not_cancellable",
                headers={"x-should-retry": "false"},
            )
        won = transition(session, batch_id, CANCELLABLE, "cancelling")
        session.commit()
        session.refresh(row)
        if won:
            try:
                enqueue(TASK_CANCEL, batch_id)
            except Exception as error:
                log.error("could not enqueue cancellation of %s: %s", batch_id, error)
                raise APIError(
                    503,
                    f"{BROKER_UNAVAILABLE} Batch {batch_id} is marked cancelling; "
                    "in-flight work stops once the broker is reachable again.",
                    code="broker_unavailable",
                ) from error
            return BatchPublic.of(row)
    raise APIError(409, f"Batch {batch_id} changed status repeatedly; retry the cancel.")
