"""``/v1/batches``: create (then enqueue validation), retrieve, list, cancel."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.batch_checks import batch_input_file, checked_window_s
from api.deps import Caller, CurrentKey, SessionDep, SettingsDep
from api.errors import APIError, invalid_request, not_found
from api.limits import max_unfinished_batches
from api.log_context import bind_batch
from api.routes.common import could_be_id, error_responses, keyset_page, list_page
from api.schemas import (
    IDEMPOTENCY_KEY_PATTERN,
    MAX_IDEMPOTENCY_KEY_CHARS,
    BatchCreate,
    BatchList,
    BatchPublic,
)
from core.auth import generate_webhook_secret, priority_allowed
from core.ids import batch_id
from core.lifecycle import CANCELLABLE, TERMINAL, UNFINISHED, BatchStatus, now, transition
from core.models import Batch
from core.netcheck import url_problem
from core.queue import TASK_CANCEL, TASK_VALIDATE, enqueue

log = logging.getLogger("batchd.api")

router = APIRouter(prefix="/batches", tags=["batches"])

BROKER_UNAVAILABLE = "The task broker is unavailable; please retry shortly."


def get_batch_row(session: Session, tenant: str, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id) if could_be_id(batch_id) else None
    if row is None or row.tenant != tenant:
        raise not_found("Batch", batch_id)
    return row


IdempotencyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        json_schema_extra={"pattern": IDEMPOTENCY_KEY_PATTERN},
        description="A repeated create with the same key (for the same tenant) returns the "
        "batch the first one created instead of creating another.",
    ),
]


def _idempotency_key(header: str | None, body: str | None) -> str | None:
    if header is not None and body is not None and header != body:
        raise invalid_request(
            "The Idempotency-Key header and the 'idempotency_key' field differ; send one.",
            param="idempotency_key",
        )
    key = header if header is not None else body
    if key is not None and not all(0x20 <= ord(ch) < 0x7F for ch in key):
        raise invalid_request(
            "An idempotency key is printable ASCII (space to '~'), at most "
            f"{MAX_IDEMPOTENCY_KEY_CHARS} characters.",
            param="idempotency_key",
        )
    return key


def _existing(session: Session, tenant: str, key: str) -> Batch | None:
    return session.scalars(
        select(Batch).where(Batch.tenant == tenant, Batch.idempotency_key == key)
    ).first()


def _replay(row: Batch, body: BatchCreate, caller: Caller) -> BatchPublic:
    """The answer to a create that repeats an idempotency key: the first create's batch, as it
    is now; a different request under the same key is a client bug and gets 409."""
    bind_batch(row.id)
    if (row.input_file_id, row.endpoint) != (body.input_file_id, body.endpoint):
        raise APIError(
            409,
            f"The idempotency key was already used for batch {row.id}, created from "
            f"{row.input_file_id} for {row.endpoint}; use a new key for a different batch.",
            param="idempotency_key",
            code="idempotency_key_reused",
            headers={"x-should-retry": "false"},
        )
    return BatchPublic.of(row, show_secret=_generated_secret(row, caller))


def _generated_secret(row: Batch, caller: Caller) -> bool:
    """A batch's webhook secret is shown to its creator only when it was generated for the
    batch; a key's own secret was shown when the key was created."""
    return row.webhook_secret is not None and row.webhook_secret != caller.webhook_secret


def _check_unfinished_quota(session: Session, tenant: str, limit: int) -> None:
    """Refuse a new batch when the tenant already has ``limit`` unfinished ones. On Postgres a
    transaction lock per tenant (held until the create commits) makes concurrent creates
    count one after another, so the limit holds under races."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
            {"lock": f"batchd.unfinished_batches:{tenant}"},
        )
    unfinished = session.scalar(
        select(func.count())
        .select_from(Batch)
        .where(Batch.tenant == tenant, Batch.status.in_(UNFINISHED))
    )
    if (unfinished or 0) >= limit:
        raise APIError(
            429,
            f"Too many unfinished batches: this tenant has {unfinished}, and the limit is "
            f"{limit} (max_unfinished_batches_per_tenant). Wait for some to finish or cancel "
            "some, then retry.",
            code="unfinished_batch_limit_exceeded",
            headers={"x-should-retry": "false"},
        )


def _priority(body: BatchCreate, caller: Caller) -> str:
    """A priority is an entitlement of the key: asking for more than the key's
    ``max_priority`` is a 403. Without one, a batch gets ``normal``, or the key's maximum
    where that is lower."""
    requested = body.priority
    if priority_allowed(requested, caller.max_priority):
        return requested
    if "priority" not in body.model_fields_set:
        return caller.max_priority
    raise APIError(
        403,
        f"This API key may create batches with priority up to '{caller.max_priority}'; "
        f"'{requested}' is above it. An administrator can create a key that may use it "
        f"(`batchd keys create --max-priority {requested}`).",
        param="priority",
        code="priority_not_allowed",
        headers={"x-should-retry": "false"},
    )


@router.post(
    "",
    response_model=BatchPublic,
    responses=error_responses(400, 403, 404, 409, 429),
    summary="Create a batch",
)
def create_batch(
    body: BatchCreate,
    caller: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyHeader = None,
) -> BatchPublic:
    key = _idempotency_key(idempotency_key, body.idempotency_key)
    priority = _priority(body, caller)
    seconds = checked_window_s(body.completion_window, caller, settings)
    if key is not None and (existing := _existing(session, caller.tenant, key)) is not None:
        return _replay(existing, body, caller)
    output_expiry_s = None
    if body.output_expires_after is not None:
        output_expiry_s = body.output_expires_after.checked_seconds("output_expires_after")
    webhook_url = body.webhook_url or caller.webhook_url
    if webhook_url is not None and (
        problem := url_problem(webhook_url, settings.webhook_allow_list())
    ):
        source = "" if body.webhook_url else " (the API key's default webhook URL)"
        raise invalid_request(
            f"Invalid value for 'webhook_url'{source}: {problem}.",
            param="webhook_url",
            code="webhook_url_not_allowed",
        )
    input_file = batch_input_file(session, caller.tenant, body.input_file_id)
    _check_unfinished_quota(session, caller.tenant, max_unfinished_batches(settings))
    webhook_secret = None
    if webhook_url is not None:
        webhook_secret = caller.webhook_secret or generate_webhook_secret()
    created = now()
    row = Batch(
        id=batch_id(),
        tenant=caller.tenant,
        endpoint=body.endpoint,
        input_file_id=input_file.id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING,
        metadata_=body.metadata,
        priority=priority,
        idempotency_key=key,
        webhook_url=webhook_url,
        webhook_secret=webhook_secret,
        output_expires_after_s=output_expiry_s,
        created_at=created,
        expires_at=created + timedelta(seconds=seconds),
        request_total=0,
        request_completed=0,
        request_failed=0,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
    )
    bind_batch(row.id)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        # A concurrent create with the same idempotency key committed first: answer with its
        # batch, exactly as if this request had come second.
        session.rollback()
        existing = _existing(session, caller.tenant, key) if key is not None else None
        if existing is None:
            raise
        return _replay(existing, body, caller)
    try:
        enqueue(TASK_VALIDATE, row.id)
    except Exception as error:
        log.error("could not enqueue validation of %s: %s", row.id, error)
        transition(
            session,
            row.id,
            BatchStatus.VALIDATING,
            BatchStatus.FAILED,
            errors=[
                {
                    "code": "broker_unavailable",
                    "message": BROKER_UNAVAILABLE,
                    "param": None,
                    "line": None,
                }
            ],
        )
        session.commit()
        raise APIError(
            503,
            f"{BROKER_UNAVAILABLE} Batch {row.id} was not started and has been marked failed.",
            code="broker_unavailable",
        ) from error
    log.info("batch %s created from %s for %s", row.id, input_file.id, row.endpoint)
    return BatchPublic.of(row, show_secret=_generated_secret(row, caller))


@router.get(
    "/{batch_id}",
    response_model=BatchPublic,
    responses=error_responses(404),
    summary="Retrieve a batch",
)
async def retrieve_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    # The polled routes are ``async def`` around one thread-pool call that does all their
    # database work: FastAPI would otherwise also check a sync route's answer in its pool.
    return await run_in_threadpool(_retrieve, session, caller.tenant, batch_id)


def _retrieve(session: Session, tenant: str, batch_id: str) -> BatchPublic:
    return BatchPublic.of(get_batch_row(session, tenant, batch_id))


@router.get("", response_model=BatchList, responses=error_responses(400), summary="List batches")
async def list_batches(
    caller: CurrentKey,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    return await run_in_threadpool(_list, session, caller, after, limit)


def _list(session: Session, caller: Caller, after: str | None, limit: int) -> BatchList:
    cursor = None
    if after is not None:
        cursor = session.get(Batch, after) if could_be_id(after) else None
        if cursor is None or cursor.tenant != caller.tenant:
            raise invalid_request(f"No such Batch object for 'after': {after}", param="after")
    query = select(Batch).where(Batch.tenant == caller.tenant)
    rows, has_more = keyset_page(session, query, Batch, cursor, descending=True, limit=limit)
    return list_page(BatchList, [BatchPublic.of(row) for row in rows], has_more)


@router.post(
    "/{batch_id}/cancel",
    response_model=BatchPublic,
    responses=error_responses(404, 409),
    summary="Cancel a batch",
)
def cancel_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    row = get_batch_row(session, caller.tenant, batch_id)
    for _ in range(3):  # the status may move under us; re-read and decide again
        if row.status == BatchStatus.CANCELLING:
            return BatchPublic.of(row)
        if row.status not in CANCELLABLE:
            raise APIError(
                409,
                f"Cannot cancel batch {batch_id}: its status is '{row.status}'"
                + (" (already finished)." if row.status in TERMINAL else "."),
                code="batch_not_cancellable",
                headers={"x-should-retry": "false"},
            )
        won = transition(session, batch_id, CANCELLABLE, BatchStatus.CANCELLING)
        session.commit()
        session.refresh(row)
        if won:
            log.info("batch %s cancelling", batch_id)
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
