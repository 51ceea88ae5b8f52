"""``/v1/uploads``: OpenAI's Uploads API (create, add part, complete, cancel), for files too
large for one request and for uploads that must survive a dropped connection."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep, UploadingKey
from api.errors import APIError
from api.routes.envelopes import error_responses
from api.schemas import FilePublic, unix
from api.services import uploads
from api.uploads import receive_upload
from core.batches.ids import upload_part_id
from core.database.sessions import session_scope
from core.database.tables import File, Upload
from core.settings import Settings
from core.storage.base import Storage

router = APIRouter(prefix="/uploads", tags=["uploads"])


class UploadCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The characters these may hold are checked by the service (400 naming the field, with
    # its reason); the patterns only tell the OpenAPI document the same rules.
    filename: str = Field(
        min_length=1,
        max_length=uploads.MAX_FILENAME_CHARS,
        json_schema_extra={"pattern": uploads.FILENAME_PATTERN},
    )
    purpose: Literal["batch"]
    # At most max_chunked_upload_bytes, a setting: the service checks it.
    bytes: int = Field(ge=1)
    mime_type: str = Field(
        min_length=1,
        max_length=uploads.MAX_MIME_TYPE_CHARS,
        json_schema_extra={"pattern": uploads.MIME_TYPE_PATTERN},
    )


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
    body: UploadCreate, caller: CurrentKey, session: SessionDep, settings: SettingsDep
) -> UploadPublic:
    row = uploads.create(
        session,
        caller,
        settings,
        filename=body.filename,
        purpose=body.purpose,
        size=body.bytes,
        mime_type=body.mime_type,
    )
    return UploadPublic.of(row)


def _admit(settings: Settings, tenant: str, upload: str) -> Upload:
    with session_scope(settings.database_url) as session:
        return uploads.admit_part(session, tenant, upload, settings.max_upload_parts)


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
    row = await run_in_threadpool(_admit, settings, caller.tenant, upload_id)
    new_part = upload_part_id()
    key = uploads.part_key(upload_id, new_part)
    # The body stops at the bytes the upload still has room for (the parts recorded
    # meanwhile are counted when this one is: add_part decides).
    room = max(0, row.bytes - row.received_bytes)
    limit = min(settings.max_upload_part_bytes, room)
    try:
        received = await receive_upload(
            request, storage, key, limit, lambda _received: None,
            tenant=caller.tenant, settings=settings, file_field="data",
        )  # fmt: skip
    except APIError as error:
        if error.status_code == 413 and limit < settings.max_upload_part_bytes:
            raise uploads.over_declared(row, None) from error
        raise
    return await run_in_threadpool(
        _record_part, settings, storage, caller.tenant, upload_id, new_part, key, received.bytes
    )


def _record_part(
    settings: Settings, storage: Storage, tenant: str, upload: str, new_part: str, key: str,
    size: int,
) -> UploadPartPublic:  # fmt: skip
    """Record a stored part; if the upload refuses it (no longer pending, no room), drop its
    bytes."""
    try:
        with session_scope(settings.database_url) as session:
            part = uploads.add_part(
                session, tenant, upload, new_part, key, size, settings.max_upload_parts
            )
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
    upload_id: str, caller: CurrentKey, session: SessionDep, settings: SettingsDep,
    storage: StorageDep,
) -> UploadPublic:  # fmt: skip
    row = uploads.cancel(
        session, storage, caller.tenant, upload_id, settings.upload_complete_lease_s
    )
    return UploadPublic.of(row)
