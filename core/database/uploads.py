"""The states of an OpenAI Upload that both the API and the upload sweep move.

``pending`` takes parts; ``completing`` is claimed by one complete, which joins the parts into
``files/<file_id>`` (the id it claimed with) and renews ``completing_since`` as it goes;
``completed``, ``cancelled`` and ``expired`` are final, and their parts are deleted. Every move
is one conditional UPDATE, so two actors never both win.

A complete that dies leaves its claim behind. Once the claim is older than
``upload_complete_lease_s`` it is given back: the upload returns to ``pending`` and the object
the dead complete was writing is deleted. Its file row never existed: a complete records its
file in the same transaction that marks the upload ``completed``, so nothing half-written is
ever a file.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from core.database.lifecycle import now
from core.database.sessions import updated
from core.database.tables import Upload, UploadPart
from core.storage.base import Storage

log = logging.getLogger(__name__)

PENDING, COMPLETED, CANCELLED, EXPIRED = "pending", "completed", "cancelled", "expired"
COMPLETING = "completing"  # while one complete joins the parts: no part, no second complete
ENDED = (COMPLETED, CANCELLED, EXPIRED)
#: Uploads one pass of the sweep takes at a time (each is its own transaction).
SWEEP_BATCH = 100


def part_prefix(upload: str) -> str:
    return f"uploads/{upload}/"


def part_key(upload: str, part: str) -> str:
    return f"{part_prefix(upload)}{part}"


def file_key(file_id: str) -> str:
    return f"files/{file_id}"


def status_of(row: Upload) -> str:
    """The status a client sees: a pending upload past its expiry is expired already."""
    if row.status == PENDING and row.expires_at <= now():
        return EXPIRED
    return row.status


def stale_claim(row: Upload, lease_s: float) -> bool:
    """Whether ``row`` is completing under a claim its complete stopped renewing."""
    return row.status == COMPLETING and (
        row.completing_since is None or row.completing_since <= now() - timedelta(seconds=lease_s)
    )


def release_stale_claim(session: Session, storage: Storage, upload: str, lease_s: float) -> bool:
    """Give a completing upload whose claim outlived ``lease_s`` back to pending and delete
    the object its complete was writing; whether this call did. A complete still alive finds
    its claim gone at its next renewal or at its commit, and drops what it wrote."""
    row = session.get(Upload, upload, populate_existing=True)
    if row is None or not stale_claim(row, lease_s):
        return False
    claimed_file, since = row.file_id, row.completing_since
    cutoff = now() - timedelta(seconds=lease_s)
    won = updated(
        session,
        update(Upload)
        .where(
            Upload.id == upload,
            Upload.status == COMPLETING,
            Upload.file_id.is_(None) if claimed_file is None else Upload.file_id == claimed_file,
            or_(Upload.completing_since.is_(None), Upload.completing_since <= cutoff),
        )
        .values(status=PENDING, file_id=None, completing_since=None),
    )
    session.commit()
    if not won:
        return False
    log.warning(
        "upload %s: its complete held the claim since %s and stopped renewing it; the upload "
        "is pending again",
        upload,
        since,
    )
    if claimed_file is not None:
        try:
            storage.delete(file_key(claimed_file))
        except Exception:  # an orphaned object is only wasted space
            log.exception("upload %s: could not delete %s", upload, file_key(claimed_file))
    return True


def drop_parts(session: Session, storage: Storage, upload: str) -> None:
    """Delete an ended upload's parts: their objects, their rows, and any object left under
    the upload's prefix by a part whose row never committed."""
    for part in list(session.scalars(select(UploadPart).where(UploadPart.upload_id == upload))):
        try:
            storage.delete(part.storage_key)
        except Exception:  # an orphaned object is only wasted space
            log.exception("could not delete part %s of upload %s", part.id, upload)
        session.delete(part)
    session.commit()
    try:
        for key in storage.list(part_prefix(upload)):  # never an in-flight write's temp file
            storage.delete(key)
    except Exception:
        log.exception("could not list the objects left under upload %s", upload)


def expire(session: Session, storage: Storage, upload: str) -> bool:
    """Mark a pending upload past its expiry ``expired`` and delete its parts; whether this
    call did."""
    won = updated(
        session,
        update(Upload)
        .where(Upload.id == upload, Upload.status == PENDING, Upload.expires_at <= now())
        .values(status=EXPIRED),
    )
    session.commit()
    if won:
        drop_parts(session, storage, upload)
    return bool(won)


def sweep(session: Session, storage: Storage, lease_s: float, limit: int = SWEEP_BATCH) -> int:
    """One pass over the uploads that need the sweep: claims older than ``lease_s`` given back
    (one past its expiry is then expired too), pending uploads past their expiry expired, and
    the parts an ended upload still has (its complete or cancel died before deleting them)
    deleted. How many uploads it changed; at most ``limit`` of each kind per pass."""
    changed = 0
    cutoff = now() - timedelta(seconds=lease_s)
    stale = session.scalars(
        select(Upload.id)
        .where(
            Upload.status == COMPLETING,
            or_(Upload.completing_since.is_(None), Upload.completing_since <= cutoff),
        )
        .limit(limit)
    ).all()
    for upload in stale:
        changed += release_stale_claim(session, storage, upload, lease_s)
    expired = session.scalars(
        select(Upload.id)
        .where(Upload.status == PENDING, Upload.expires_at <= now())
        .order_by(Upload.expires_at)
        .limit(limit)
    ).all()
    for upload in expired:
        changed += expire(session, storage, upload)
    leftovers = session.scalars(
        select(UploadPart.upload_id)
        .join(Upload, Upload.id == UploadPart.upload_id)
        .where(Upload.status.in_(ENDED))
        .distinct()
        .limit(limit)
    ).all()
    session.commit()
    for upload in leftovers:
        drop_parts(session, storage, upload)
        changed += 1
    return changed


def sweep_all(session: Session, storage: Storage, lease_s: float) -> int:
    """:func:`sweep` until a pass finds nothing left to do; how many uploads it changed."""
    total = 0
    while changed := sweep(session, storage, lease_s):
        total += changed
    return total
