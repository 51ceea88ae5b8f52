"""``/v1/batches``: create (then enqueue validation), retrieve, list, cancel, pause, resume."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from api.deps import Caller, CurrentKey, SessionDep, SettingsDep
from api.errors import invalid_request
from api.routes.envelopes import error_responses, list_page
from api.schemas import (
    IDEMPOTENCY_KEY_PATTERN,
    MAX_IDEMPOTENCY_KEY_CHARS,
    BatchCreate,
    BatchList,
    BatchPublic,
)
from api.services import batches
from core.database.tables import Batch

router = APIRouter(prefix="/batches", tags=["batches"])


IdempotencyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        json_schema_extra={"pattern": IDEMPOTENCY_KEY_PATTERN},
        description="A repeated create (or retry) with the same key (for the same tenant) "
        "returns the batch the first one created instead of creating another.",
    ),
]


def idempotency_key_of(header: str | None, body: str | None) -> str | None:
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


def created_batch(row: Batch, caller: Caller) -> BatchPublic:
    """A created batch as its creator sees it (with a webhook secret generated for it)."""
    return BatchPublic.of(row, show_secret=batches.shows_secret(row, caller))


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
    key = idempotency_key_of(idempotency_key, body.idempotency_key)
    return created_batch(batches.create_batch(session, settings, caller, body, key), caller)


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
    return BatchPublic.of(batches.get_batch_row(session, tenant, batch_id))


@router.get("", response_model=BatchList, responses=error_responses(400), summary="List batches")
async def list_batches(
    caller: CurrentKey,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    return await run_in_threadpool(_list, session, caller.tenant, after, limit)


def _list(session: Session, tenant: str, after: str | None, limit: int) -> BatchList:
    rows, has_more = batches.list_batches(session, tenant, after, limit)
    return list_page(BatchList, [BatchPublic.of(row) for row in rows], has_more)


@router.post(
    "/{batch_id}/cancel",
    response_model=BatchPublic,
    responses=error_responses(404, 409),
    summary="Cancel a batch",
)
def cancel_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    return BatchPublic.of(batches.cancel_batch(session, caller.tenant, batch_id))


@router.post(
    "/{batch_id}/pause",
    response_model=BatchPublic,
    responses=error_responses(404, 409),
    summary="Pause a batch (extension)",
)
def pause_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    return BatchPublic.of(batches.pause_batch(session, caller.tenant, batch_id))


@router.post(
    "/{batch_id}/resume",
    response_model=BatchPublic,
    responses=error_responses(404, 409),
    summary="Resume a paused batch (extension)",
)
def resume_batch(batch_id: str, caller: CurrentKey, session: SessionDep) -> BatchPublic:
    return BatchPublic.of(batches.resume_batch(session, caller.tenant, batch_id))
