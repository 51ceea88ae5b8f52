"""``/v1/uploads``: OpenAI's Uploads API (create, add part, complete, cancel), for files too
large for one request and for uploads that must survive a dropped connection."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep, UploadingKey
from api.errors import invalid_request
from api.routes.common import error_responses
from api.schemas import FilePublic, unix
from api.services import uploads
from api.uploads import receive_upload, sanitize_filename
from core.db import session_scope
from core.ids import upload_part_id
from core.storage.base import Storage
from core.tables import File, Upload

router = APIRouter(prefix="/uploads", tags=["uploads"])


class UploadCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: str = Field(min_length=1, max_length=1024)
    purpose: Literal["batch"]
    bytes: int = Field(ge=1, le=uploads.MAX_UPLOAD_BYTES)
    mime_type: str = Field(max_length=128)


class UploadComplete(BaseModel):
    model_config = ConfigDict(extra="forbid")

    part_ids: list[str] = Field(min_length=1, max_length=10_000)
    md5: str | None = Field(default=None, max_length=64)


class UploadPublic(BaseModel):
    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    expires_at: int
    file: FilePublic | None = None

    @classmethod
    def of(cls, row: Upload, file: File | None = None) -> UploadPublic:
        status = uploads.status_of(row)
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=unix(row.created_at) or 0,
            filename=row.filename,
            purpose=row.purpose,
            # "completing" lasts as long as one complete call; outside it is still pending.
            status="pending" if status == uploads.COMPLETING else status,  # type: ignore[arg-type]
            expires_at=unix(row.expires_at) or 0,
            file=None if file is None else FilePublic.of(file),
        )


class UploadPartPublic(BaseModel):
    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int
    upload_id: str


@router.post(
    "", response_model=UploadPublic, responses=error_responses(400), summary="Create an upload"
)
def create_upload(
    body: UploadCreate, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> UploadPublic:
    filename = sanitize_filename(body.filename)
    if not filename:
        raise invalid_request("Invalid value for 'filename': it holds no usable name.", "filename")
    row = uploads.create(
        session,
        storage,
        caller,
        filename=filename,
        purpose=body.purpose,
        size=body.bytes,
        mime_type=body.mime_type,
    )
    return UploadPublic.of(row)


def _check_pending(database_url: str, tenant: str, upload: str) -> None:
    with session_scope(database_url) as session:
        uploads.pending_upload(session, tenant, upload)


_PART_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string", "format": "binary"}},
                }
            }
        },
    }
}


@router.post(
    "/{upload_id}/parts",
    response_model=UploadPartPublic,
    openapi_extra=_PART_SCHEMA,
    responses=error_responses(400, 404, 408, 413),
    summary="Add a part to an upload (multipart field 'data', at most 64 MB)",
)
async def add_part(
    upload_id: str,
    request: Request,
    caller: UploadingKey,
    settings: SettingsDep,
    storage: StorageDep,
) -> UploadPartPublic:
    await run_in_threadpool(_check_pending, settings.database_url, caller.tenant, upload_id)
    new_part = upload_part_id()
    key = uploads.part_key(upload_id, new_part)

    received = await receive_upload(
        request, storage, key, uploads.MAX_PART_BYTES, lambda _received: None,
        tenant=caller.tenant, settings=settings, file_field="data",
    )  # fmt: skip
    return await run_in_threadpool(
        _record_part, settings.database_url, storage, caller.tenant, upload_id, new_part, key,
        received.bytes,
    )  # fmt: skip


def _record_part(
    database_url: str, storage: Storage, tenant: str, upload: str, new_part: str, key: str,
    size: int,
) -> UploadPartPublic:  # fmt: skip
    """Record a stored part; if the upload stopped being pending meanwhile, drop its bytes."""
    try:
        with session_scope(database_url) as session:
            row = uploads.pending_upload(session, tenant, upload)
            part = uploads.add_part(session, row, new_part, key, size)
            return UploadPartPublic(
                id=part.id, created_at=unix(part.created_at) or 0, upload_id=upload
            )
    except BaseException:
        storage.delete(key)
        raise


@router.post(
    "/{upload_id}/complete",
    response_model=UploadPublic,
    responses=error_responses(400, 404, 409),
    summary="Complete an upload: join its parts, in part_ids order, into a file",
)
def complete_upload(
    upload_id: str,
    body: UploadComplete,
    caller: CurrentKey,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
) -> UploadPublic:
    row, file = uploads.complete(
        session, storage, caller.tenant, upload_id, body.part_ids, body.md5, settings
    )
    return UploadPublic.of(row, file)


@router.post(
    "/{upload_id}/cancel",
    response_model=UploadPublic,
    responses=error_responses(400, 404, 409),
    summary="Cancel an upload: its parts are deleted",
)
def cancel_upload(
    upload_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> UploadPublic:
    return UploadPublic.of(uploads.cancel(session, storage, caller.tenant, upload_id))
