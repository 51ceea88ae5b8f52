"""OpenAI's Uploads: a file sent in parts (each streamed to its own object), joined in the
order ``part_ids`` gives when the upload completes, and then an ordinary file.

A part sent twice is two parts; only those ``complete`` names are joined, the rest are
deleted. A client that dies mid-upload resumes by adding the parts it has not sent to the
same upload, until the upload expires (an hour after its creation, as OpenAI's); expired and
cancelled uploads lose their parts.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request, not_found
from api.services import files
from api.services.common import could_be_id
from core.db import updated
from core.ids import file_id
from core.ids import upload_id as new_upload_id
from core.lifecycle import now
from core.settings import Settings
from core.storage.base import Storage
from core.tables import File, Upload, UploadPart

log = logging.getLogger("batchd.api")

#: OpenAI's limits: a part holds at most 64 MB, an upload lives an hour, holds at most 8 GB.
MAX_PART_BYTES = 64 * 1024 * 1024
UPLOAD_LIFETIME = timedelta(hours=1)
MAX_UPLOAD_BYTES = 8 * 1024**3
#: Expired uploads whose parts one create cleans up (the rest wait for the next creates).
SWEEP_BATCH = 16

PENDING, COMPLETED, CANCELLED, EXPIRED = "pending", "completed", "cancelled", "expired"
COMPLETING = "completing"  # while the parts are joined: no part is added, no second complete


def part_key(upload: str, part: str) -> str:
    return f"uploads/{upload}/{part}"


def status_of(row: Upload) -> str:
    if row.status == PENDING and row.expires_at <= now():
        return EXPIRED
    return row.status


def get_upload(session: Session, tenant: str, upload: str) -> Upload:
    row = session.get(Upload, upload) if could_be_id(upload) else None
    if row is None or row.tenant != tenant:
        raise not_found("Upload", upload)
    return row


def pending_upload(session: Session, tenant: str, upload: str) -> Upload:
    """The tenant's upload, which must still take parts (400 once it is not pending)."""
    row = get_upload(session, tenant, upload)
    status = status_of(row)
    if status != PENDING:
        raise invalid_request(
            f"Upload {upload} is {status}; parts can only be added to a pending upload, and "
            "it can only be completed or cancelled while pending.",
            code="upload_not_pending",
        )
    return row


def create(
    session: Session,
    storage: Storage,
    caller: Caller,
    *,
    filename: str,
    purpose: str,
    size: int,
    mime_type: str,
) -> Upload:
    if purpose != "batch":
        raise invalid_request(
            f"Invalid value for 'purpose': {purpose[:64]!r}; batchd accepts 'batch'.", "purpose"
        )
    if not 0 < size <= MAX_UPLOAD_BYTES:
        raise invalid_request(
            f"Invalid value for 'bytes': {size}; an upload holds from 1 to {MAX_UPLOAD_BYTES} "
            "bytes.",
            "bytes",
        )
    sweep_expired(session, storage)
    created = now()
    row = Upload(
        id=new_upload_id(),
        tenant=caller.tenant,
        filename=filename,
        purpose=purpose,
        mime_type=mime_type,
        bytes=size,
        status=PENDING,
        created_at=created,
        expires_at=created + UPLOAD_LIFETIME,
    )
    session.add(row)
    session.commit()
    return row


def add_part(session: Session, row: Upload, new_part: str, key: str, size: int) -> UploadPart:
    """Record a part whose bytes are stored at ``key``; a part of an upload that stopped
    being pending meanwhile is refused and its bytes dropped by the caller."""
    part = UploadPart(id=new_part, upload_id=row.id, bytes=size, storage_key=key, created_at=now())
    session.add(part)
    session.commit()
    return part


def _drop_parts(session: Session, storage: Storage, upload: str) -> None:
    for part in list(session.scalars(select(UploadPart).where(UploadPart.upload_id == upload))):
        try:
            storage.delete(part.storage_key)
        except Exception:  # an orphaned object is only wasted space
            log.exception("could not delete part %s of upload %s", part.id, upload)
        session.delete(part)
    session.commit()


def cancel(session: Session, storage: Storage, tenant: str, upload: str) -> Upload:
    row = pending_upload(session, tenant, upload)
    if not _claim(session, row.id, PENDING, CANCELLED):
        raise APIError(409, f"Upload {row.id} is being completed; it cannot be cancelled.")
    session.refresh(row)
    _drop_parts(session, storage, row.id)
    return row


def complete(
    session: Session,
    storage: Storage,
    tenant: str,
    upload: str,
    part_ids: list[str],
    md5: str | None,
    settings: Settings,
) -> tuple[Upload, File]:
    """Join the parts in ``part_ids`` order into a new file (streamed, chunk by chunk), check
    its size against the one declared and its MD5 against ``md5``, and complete the upload."""
    row = pending_upload(session, tenant, upload)
    if not part_ids:
        raise invalid_request("part_ids must name at least one part.", "part_ids")
    if len(set(part_ids)) != len(part_ids):
        raise invalid_request("part_ids names a part twice.", "part_ids")
    parts = {
        p.id: p for p in session.scalars(select(UploadPart).where(UploadPart.upload_id == row.id))
    }
    for i, part in enumerate(part_ids):
        if part not in parts:
            raise invalid_request(
                f"part_ids[{i}]: {part!r} is not a part of upload {row.id}.", f"part_ids[{i}]"
            )
    total = sum(parts[p].bytes for p in part_ids)
    if total != row.bytes:
        raise invalid_request(
            f"The parts named hold {total} bytes, but the upload was created for {row.bytes} "
            "bytes.",
            "part_ids",
        )
    if not _claim(session, row.id, PENDING, COMPLETING):
        raise APIError(409, f"Upload {row.id} is already being completed or cancelled.")
    new_id = file_id()
    key = f"files/{new_id}"
    file_row = files.new_file_row(
        tenant, new_id, row.purpose, row.filename, total, key, settings.file_expiry_s
    )
    try:
        join_parts(storage, key, [parts[p].storage_key for p in part_ids], md5)
        files.record_upload(settings.database_url, storage, file_row)
    except BaseException:
        session.rollback()
        _claim(session, row.id, COMPLETING, PENDING)  # the client may complete it again
        raise
    session.refresh(row)
    row.status = COMPLETED
    row.file_id = new_id
    session.commit()
    _drop_parts(session, storage, row.id)
    return row, file_row


def _claim(session: Session, upload: str, expected: str, status: str) -> bool:
    """Move the upload from ``expected`` to ``status`` in one conditional UPDATE."""
    won = updated(
        session,
        update(Upload).where(Upload.id == upload, Upload.status == expected).values(status=status),
    )
    session.commit()
    return bool(won)


def join_parts(storage: Storage, key: str, sources: list[str], md5: str | None) -> None:
    """Write the ``sources`` one after another to ``key``, a chunk at a time; if ``md5`` is
    given and differs, leave the writer by an exception, which discards the object."""
    digest = hashlib.md5(usedforsecurity=False)
    with storage.writer(key) as out:
        for source in sources:
            for chunk in storage.iter_chunks(source):
                digest.update(chunk)
                out.write(chunk)
        if md5 is not None and digest.hexdigest() != md5.strip().lower():
            raise invalid_request(
                f"The MD5 of the joined parts is {digest.hexdigest()}, not {md5}.", "md5"
            )


def sweep_expired(session: Session, storage: Storage, limit: int = SWEEP_BATCH) -> int:
    """Mark up to ``limit`` pending uploads past their expiry as expired and delete their
    parts; how many were."""
    rows = list(
        session.scalars(
            select(Upload).where(Upload.status == PENDING, Upload.expires_at <= now()).limit(limit)
        )
    )
    for row in rows:
        row.status = EXPIRED
        session.commit()
        _drop_parts(session, storage, row.id)
    return len(rows)
