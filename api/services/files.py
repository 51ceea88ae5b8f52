"""File rows: look-up (a live file of the caller's), recording an upload, listing, deleting."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import false, or_, select
from sqlalchemy.orm import Session

from api.errors import invalid_request, not_found
from api.services.lookups import could_be_id, keyset_page
from core.database import results_log
from core.database.lifecycle import TERMINAL, now
from core.database.sessions import session_scope
from core.database.tables import Batch, File
from core.observability import metrics
from core.storage.base import Storage

log = logging.getLogger("batchd.api")


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


def record_upload(database_url: str, storage: Storage, row: File) -> File:
    """Commit the row of an upload whose bytes are stored; if it cannot commit, the bytes go."""
    try:
        with session_scope(database_url) as session:
            session.add(row)
    except BaseException:
        try:  # the row never committed: drop the bytes it would have pointed at
            storage.delete(row.storage_key)
        except Exception:
            log.exception(
                "could not delete %s after its file row failed to commit", row.storage_key
            )
        raise
    metrics.UPLOADS.inc()
    metrics.UPLOAD_BYTES.inc(row.bytes)
    return row


def new_file_row(
    tenant: str, new_id: str, purpose: str, filename: str, size: int, key: str, expiry_s: int
) -> File:
    """The row of a file created now, expiring ``expiry_s`` seconds later."""
    created = now()
    return File(
        id=new_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename,
        bytes=size,
        storage_key=key,
        created_at=created,
        expires_at=created + timedelta(seconds=expiry_s),
    )


def list_files(
    session: Session,
    tenant: str,
    purpose: str | None,
    after: str | None,
    *,
    descending: bool,
    limit: int,
) -> tuple[list[File], bool]:
    """A page of the tenant's live files, and whether more follow."""
    query = select(File).where(
        File.tenant == tenant, or_(File.expires_at.is_(None), File.expires_at > now())
    )
    if purpose is not None:
        # No purpose holds a NUL (which the database would refuse): nothing matches it.
        query = query.where(File.purpose == purpose if "\x00" not in purpose else false())
    cursor = None
    if after is not None:
        cursor = session.get(File, after) if could_be_id(after) else None
        if cursor is None or cursor.tenant != tenant or is_expired(cursor):
            raise invalid_request(f"No such File object for 'after': {after}", param="after")
    return keyset_page(session, query, File, cursor, descending=descending, limit=limit)


def producing_batch(session: Session, row: File) -> str | None:
    """The batch whose output or error file this is, if any."""
    return session.scalar(
        select(Batch.id)
        .where(
            Batch.tenant == row.tenant,
            or_(Batch.output_file_id == row.id, Batch.error_file_id == row.id),
        )
        .limit(1)
    )


def delete_file(session: Session, storage: Storage, tenant: str, file_id: str) -> None:
    """Delete the tenant's file: its row and its bytes, or, while a batch that has not ended
    still reads it, hide it now and leave the deleting to the retention sweep."""
    row = get_file_row(session, tenant, file_id)
    key = row.storage_key
    in_use = session.scalar(
        select(Batch.id)
        .where(Batch.input_file_id == row.id, Batch.status.not_in(TERMINAL))
        .limit(1)
    )
    if in_use is not None:
        # Expired files answer 404 everywhere.
        row.expires_at = now()
        session.commit()
        return
    session.delete(row)
    logs = results_log.drop_for_files(session, [row.id])
    session.commit()
    for batch_id in logs:  # a result file deleted: its batch's results are not served or kept
        try:
            storage.delete_prefix(results_log.batch_log_prefix(batch_id))
        except Exception:
            log.exception("batch %s: results log forgotten, its chunks were not", batch_id)
    try:
        storage.delete(key)
    except Exception:  # the row is gone; an orphaned object is only wasted space
        log.exception("could not delete the stored object %s of file %s", key, file_id)
