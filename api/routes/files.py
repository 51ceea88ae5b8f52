"""``/v1/files``: upload (streamed to storage), list, retrieve, download, delete."""

from __future__ import annotations

import logging
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep, UploadingKey
from api.errors import APIError, invalid_request
from api.log_context import bind_batch
from api.routes.envelopes import error_responses, list_page
from api.schemas import MAX_EXPIRY_S, MIN_EXPIRY_S, FileDeleted, FileList, FilePublic
from api.services import files
from api.uploads import Upload, receive_upload
from core.batches.ids import file_id
from core.storage.base import ObjectNotFound

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
    responses=error_responses(400, 408, 413),
    summary="Upload a file",
)
async def create_file(
    request: Request, caller: UploadingKey, settings: SettingsDep, storage: StorageDep
) -> FilePublic:
    new_id = file_id()
    key = f"files/{new_id}"

    expiry_s = settings.file_expiry_s

    def finish(upload: Upload) -> None:
        nonlocal expiry_s
        expiry_s = _validate_fields(upload, settings.file_expiry_s)

    upload = await receive_upload(
        request, storage, key, settings.max_upload_bytes, finish,
        tenant=caller.tenant, settings=settings,
    )  # fmt: skip
    row = files.new_file_row(
        caller.tenant,
        new_id,
        upload.fields["purpose"],
        upload.filename or "upload.jsonl",
        upload.bytes,
        key,
        expiry_s,
    )
    return FilePublic.of(
        await run_in_threadpool(files.record_upload, settings.database_url, storage, row)
    )


@router.get("", response_model=FileList, responses=error_responses(400), summary="List files")
def list_files(
    caller: CurrentKey,
    session: SessionDep,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: Annotated[str | None, Query(max_length=64)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> FileList:
    rows, has_more = files.list_files(
        session, caller.tenant, purpose, after, descending=order == "desc", limit=limit
    )
    return list_page(FileList, [FilePublic.of(row) for row in rows], has_more)


@router.get(
    "/{file_id}",
    response_model=FilePublic,
    responses=error_responses(404),
    summary="Retrieve a file",
)
def retrieve_file(file_id: str, caller: CurrentKey, session: SessionDep) -> FilePublic:
    return FilePublic.of(files.get_file_row(session, caller.tenant, file_id))


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
    row = files.get_file_row(session, caller.tenant, file_id)
    if row.purpose == "batch_output" and (batch := files.producing_batch(session, row)):
        bind_batch(batch)  # the download's log lines carry the batch that produced the file
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


@router.delete(
    "/{file_id}",
    response_model=FileDeleted,
    responses=error_responses(404),
    summary="Delete a file",
)
def delete_file(
    file_id: str, caller: CurrentKey, session: SessionDep, storage: StorageDep
) -> FileDeleted:
    files.delete_file(session, storage, caller.tenant, file_id)
    return FileDeleted(id=file_id)
