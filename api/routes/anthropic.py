"""``/v1/messages/batches``: Anthropic's Message Batches API (create, retrieve, list, cancel,
delete, results), for the ``anthropic`` SDK unmodified. The key comes in ``x-api-key`` (or
``Authorization: Bearer``), every call names an ``anthropic-version``, and errors use
Anthropic's envelope (see :mod:`api.errors`)."""

from __future__ import annotations

import email.message
import tempfile
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep
from api.errors import invalid_request
from api.routes.envelopes import error_responses
from api.services import anthropic


async def _version(
    version: Annotated[str | None, Header(alias="anthropic-version")] = None,
) -> None:
    if not version:
        raise invalid_request("anthropic-version: header is required", "anthropic-version")


router = APIRouter(prefix="/messages/batches", tags=["anthropic"], dependencies=[Depends(_version)])

_RESPONSES = error_responses(400, 404)
#: The body is written to its temporary file this many bytes at a time.
SPOOL_WRITE_BYTES = 1024 * 1024


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this type as JSON (``application/json`` or
    ``application/*+json``; no type at all is not)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def _spool(request: Request, spool: BinaryIO) -> bool:
    """Write the body to ``spool`` as it arrives (the gate cuts it at the route's limit),
    a few chunks per write in the thread pool; whether it held a byte."""
    pending = bytearray()
    size = 0
    try:
        async for chunk in request.stream():
            pending += chunk
            if len(pending) >= SPOOL_WRITE_BYTES:
                await run_in_threadpool(spool.write, pending)
                size += len(pending)
                pending.clear()
    except ClientDisconnect as error:
        raise invalid_request("The client went away before the request body ended.") from error
    if pending:
        await run_in_threadpool(spool.write, pending)
        size += len(pending)
    spool.seek(0)
    return size > 0


@router.post("", responses=_RESPONSES, summary="Create a message batch")
async def create(
    request: Request,
    caller: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
) -> dict[str, Any]:
    """The body (at most ``max_message_batch_bytes``) goes to a temporary file as it arrives
    and is read back one request at a time: never whole in memory, nor parsed whole."""

    def create_and_show(body: BinaryIO | None) -> dict[str, Any]:
        row = anthropic.create(session, settings, storage, caller, body)
        return anthropic.view(session, storage, row).public(str(request.base_url))

    if not _is_json(request.headers.get("content-type")):
        return await run_in_threadpool(create_and_show, None)
    with tempfile.TemporaryFile(prefix="batchd-message-batch-body-") as spool:
        held = await _spool(request, spool)
        return await run_in_threadpool(create_and_show, spool if held else None)


@router.get("", responses=_RESPONSES, summary="List message batches")
def list_batches(
    request: Request,
    caller: CurrentKey,
    session: SessionDep,
    storage: StorageDep,
    before_id: Annotated[str | None, Query(max_length=64)] = None,
    after_id: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict[str, Any]:
    rows, has_more = anthropic.list_rows(session, caller.tenant, before_id, after_id, limit)
    base = str(request.base_url)
    data = [anthropic.view(session, storage, row).public(base) for row in rows]
    return {
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/{batch_id}", responses=_RESPONSES, summary="Retrieve a message batch")
def retrieve(
    batch_id: str, request: Request, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> dict[str, Any]:
    row = anthropic.get_row(session, caller.tenant, batch_id)
    return anthropic.view(session, storage, row).public(str(request.base_url))


@router.post("/{batch_id}/cancel", responses=_RESPONSES, summary="Cancel a message batch")
def cancel(
    batch_id: str, request: Request, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> dict[str, Any]:
    row = anthropic.get_row(session, caller.tenant, batch_id)
    return anthropic.cancel(session, storage, row).public(str(request.base_url))


@router.delete("/{batch_id}", responses=_RESPONSES, summary="Delete an ended message batch")
def delete(
    batch_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> dict[str, Any]:
    anthropic.delete(session, storage, anthropic.get_row(session, caller.tenant, batch_id))
    return {"id": batch_id, "type": "message_batch_deleted"}


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses=_RESPONSES,
    summary="Stream a message batch's results (JSONL, in request order)",
)
def results(
    batch_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> StreamingResponse:
    row = anthropic.get_row(session, caller.tenant, batch_id)
    if anthropic.view(session, storage, row).status != "ended":
        raise invalid_request(
            f"Message batch {batch_id} is still being processed; its results are available "
            "once its processing_status is 'ended'."
        )
    return StreamingResponse(
        anthropic.results(session, storage, row), media_type="application/binary"
    )
