"""``/v1/files``: upload (streamed to storage), list, retrieve, download, delete."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import false, or_, select
from sqlalchemy.orm import Session

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep
from api.errors import APIError, invalid_request, not_found
from api.log_context import bind_batch
from api.routes.common import could_be_id, error_responses, keyset_page, list_page
from api.schemas import MAX_EXPIRY_S, MIN_EXPIRY_S, FileDeleted, FileList, FilePublic
from api.uploads import Upload, receive_upload
from core import metrics
from core.db import session_scope
from core.ids import file_id
from core.lifecycle import TERMINAL, now
from core.models import Batch, File
from core.storage import ObjectNotFound

log = logging.getLogger("batchd.api")

router = APIRouter(prefix="/files", tags=["files"])

ACCEPTED_PURPOSES = ("batch",)

_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    # OpenAI's expires_after: both fields or neither.
                    "dependentRequired": {
                        "expires_after[anchor]": ["expires_after[seconds]"],
                        "expires_after[seconds]": ["expires_after[anchor]"],
                    },
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(ACCEPTED_PURPOSES)},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {
                            "type": "integer",
                            "minimum": MIN_EXPIRY_S,
                            "maximum": MAX_EXPIRY_S,
                        },
                    },
                }
            }
        },
    }
}


def is_expired(row: File) -> bool:
    expires_at = row.expires_at
    if expires_at is None:
        return False
    return expires_at <= now()


def get_file_row(session: Session, tenant: str, file_id: str, param: str | None = None) -> File:
    """The caller's live file. Another tenant's file and an expired one (whose bytes the
    retention sweep deletes) answer exactly like a missing one."""
    row = session.get(File, file_id) if could_be_id(file_id) else None
    if row is None or row.tenant != tenant or is_expired(row):
        raise not_found("File", file_id, param=param)
    return row


def _expiry_seconds(fields: dict[str, str], default: int) -> int:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default
    if anchor != "created_at":
        raise invalid_request(
            "Invalid value for 'expires_after[anchor]': expected 'created_at'.",
            param="expires_after.anchor",
        )
    try:
        value = int(seconds or "")
    except ValueError:
        value = -1
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise invalid_request(
            f"Invalid value for 'expires_after[seconds]': expected an integer between "
            f"{MIN_EXPIRY_S} and {MAX_EXPIRY_S}.",
            param="expires_after.seconds",
        )
    return value


def _validate_fields(upload: Upload, default_expiry_s: int) -> int:
    """Check the form fields; the file's lifetime in seconds."""
    purpose = upload.fields.get("purpose")
    if purpose is None:
        raise invalid_request("Missing required parameter: 'purpose'.", param="purpose")
    if purpose not in ACCEPTED_PURPOSES:
        raise invalid_request(
            f"Invalid value for 'purpose': {purpose[:64]!r}; batchd accepts 'batch'.",
            param="purpose",
        )
    return _expiry_seconds(upload.fields, default_expiry_s)


@router.post(
    "",
    response_model=FilePublic,
    openapi_extra=_UPLOAD_SCHEMA,
    responses=error_responses(400, 413),
    summary="Upload a file",
)
async def create_file(
    request: Request, caller: CurrentKey, settings: SettingsDep, storage: StorageDep
) -> FilePublic:
    new_id = file_id()
    key = f"files/{new_id}"

    expiry_s = settings.file_expiry_s

    def finish(upload: Upload) -> None:
        nonlocal expiry_s
        expiry_s = _validate_fields(upload, settings.file_expiry_s)

    upload = await receive_upload(request, storage, key, settings.max_upload_bytes, finish)

    def record() -> File:
        created = now()
        row = File(
            id=new_id,
            tenant=caller.tenant,
            purpose=upload.fields["purpose"],
            filename=upload.filename or "upload.jsonl",
            bytes=upload.bytes,
            storage_key=key,
            created_at=created,
            expires_at=created + timedelta(seconds=expiry_s),
        )
        try:
            with session_scope(settings.database_url) as session:
                session.add(row)
        except BaseException:
            try:  # the row never committed: drop the bytes it would have pointed at
                storage.delete(key)
            except Exception:
                log.exception("could not delete %s after its file row failed to commit", key)
            raise
        metrics.UPLOADS.inc()
        metrics.UPLOAD_BYTES.inc(upload.bytes)
        return row

    return FilePublic.of(await run_in_threadpool(record))


@router.get("", response_model=FileList, responses=error_responses(400), summary="List files")
def list_files(
    caller: CurrentKey,
    session: SessionDep,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: Annotated[str | None, Query(max_length=64)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> FileList:
    query = select(File).where(
        File.tenant == caller.tenant, or_(File.expires_at.is_(None), File.expires_at > now())
    )
    if purpose is not None:
        # No purpose holds a NUL (which the database would refuse): nothing matches it.
        query = query.where(File.purpose == purpose if "\x00" not in purpose else false())
    cursor = None
    if after is not None:
        cursor = session.get(File, after) if could_be_id(after) else None
        if cursor is None or cursor.tenant != caller.tenant or is_expired(cursor):
            raise invalid_request(f"No such File object for 'after': {after}", param="after")
    rows, has_more = keyset_page(
        session, query, File, cursor, descending=order == "desc", limit=limit
    )
    return list_page(FileList, [FilePublic.of(row) for row in rows], has_more)


@router.get(
    "/{file_id}",
    response_model=FilePublic,
    responses=error_responses(404),
    summary="Retrieve a file",
)
def retrieve_file(file_id: str, caller: CurrentKey, session: SessionDep) -> FilePublic:
    return FilePublic.of(get_file_row(session, caller.tenant, file_id))


def _content_disposition(filename: str) -> str:
    ascii_name = "".join(
        ch if 0x20 <= ord(ch) < 0x7F and ch not in '"\\;' else "_" for ch in filename
    )
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/jsonl": {"schema": {"type": "string", "format": "binary"}},
            },
            "description": "The file's bytes",
        },
        **error_responses(404),
    },
    summary="Download a file's content",
)
def file_content(
    file_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> StreamingResponse:
    row = get_file_row(session, caller.tenant, file_id)
    if row.purpose == "batch_output":
        _bind_producing_batch(session, row)
    try:
        size = storage.size(row.storage_key)
        chunks = storage.read_range(row.storage_key, 0, size)
    except ObjectNotFound as error:
        log.error("file %s has a row but no stored object at %s", row.id, row.storage_key)
        raise APIError(404, f"The content of file {file_id} is no longer available.") from error
    media_type = (
        "application/jsonl" if row.filename.endswith(".jsonl") else "application/octet-stream"
    )
    return StreamingResponse(
        chunks,
        media_type=media_type,
        headers={
            "Content-Length": str(size),
            "Content-Disposition": _content_disposition(row.filename),
            "X-Content-Type-Options": "nosniff",
        },
    )


def _bind_producing_batch(session: Session, row: File) -> None:
    """The download's log lines carry the batch whose output or error file this is."""
    produced_by = session.scalar(
        select(Batch.id)
        .where(
            Batch.tenant == row.tenant,
            or_(Batch.output_file_id == row.id, Batch.error_file_id == row.id),
        )
        .limit(1)
    )
    if produced_by is not None:
        bind_batch(produced_by)


@router.delete(
    "/{file_id}",
    response_model=FileDeleted,
    responses=error_responses(404),
    summary="Delete a file",
)
def delete_file(
    file_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> FileDeleted:
    row = get_file_row(session, caller.tenant, file_id)
    key = row.storage_key
    in_use = session.scalar(
        select(Batch.id)
        .where(Batch.input_file_id == row.id, Batch.status.not_in(TERMINAL))
        .limit(1)
    )
    if in_use is not None:
        # A batch that has not ended still reads this file: hide it now (expired files answer
        # 404 everywhere) and let the retention sweep delete it once the batch ends.
        row.expires_at = now()
        session.commit()
        return FileDeleted(id=file_id)
    session.delete(row)
    session.commit()
    try:
        storage.delete(key)
    except Exception:  # the row is gone; an orphaned object is only wasted space
        log.exception("could not delete the stored object %s of file %s", key, file_id)
    return FileDeleted(id=file_id)
