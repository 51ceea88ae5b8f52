"""OpenAI's Uploads: a file sent in parts (each streamed to its own object), joined in the
order ``part_ids`` gives when the upload completes, and then an ordinary file.

An upload declares its size (at most ``max_chunked_upload_bytes``), and its parts together
never hold more: a part that would take them past the declared ``bytes``, or past
``max_upload_parts`` parts, is refused, by the same conditional UPDATE of the upload row that
admits it (concurrent parts cannot both slip under a bound, and no part is recorded once the
upload stopped being pending). A client that dies mid-upload resumes by adding the parts it
has not sent to the same upload, until the upload expires (an hour after its creation, as
OpenAI's); the upload sweep (``core.database.uploads``) then marks it ``expired`` and deletes its
parts.
"""

from __future__ import annotations

import hashlib
import logging
import time
import unicodedata
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request, not_found
from api.services import files
from api.services.lookups import could_be_id
from api.uploads import clean_filename
from core.batches.ids import file_id
from core.batches.ids import upload_id as new_upload_id
from core.database.lifecycle import now
from core.database.sessions import updated
from core.database.tables import File, Upload, UploadPart
from core.database.uploads import (
    CANCELLED,
    COMPLETED,
    COMPLETING,
    EXPIRED,
    PENDING,
    drop_parts,
    file_key,
    part_key,
    release_stale_claim,
    status_of,
)
from core.observability import metrics
from core.settings import Settings
from core.storage.base import Storage

__all__ = [
    "CANCELLED",
    "COMPLETED",
    "COMPLETING",
    "EXPIRED",
    "PENDING",
    "UPLOAD_LIFETIME",
    "add_part",
    "admit_part",
    "cancel",
    "complete",
    "create",
    "get_upload",
    "join_parts",
    "part_key",
    "pending_upload",
    "status_of",
]

log = logging.getLogger("batchd.api")

#: OpenAI's limit: an upload lives an hour (a part's limit: settings.max_upload_part_bytes).
UPLOAD_LIFETIME = timedelta(hours=1)
#: The longest ``filename`` and ``mime_type`` a create takes (the name is then cut to 255).
MAX_FILENAME_CHARS = 1024
MAX_MIME_TYPE_CHARS = 128
#: Characters no file name may hold: control characters (NUL and newlines among them), lone
#: surrogates (not Unicode text: the database cannot store them), line and paragraph
#: separators.
_FORBIDDEN_IN_NAMES = {"Cc", "Cs", "Zl", "Zp"}
#: The same rules as regular expressions, for the OpenAPI document (lone surrogates, which
#: are no Unicode text, are left out: many regular expression engines cannot name them).
FILENAME_PATTERN = "^[^\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029]*$"
MIME_TYPE_PATTERN = "^[ -~]*$"


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


def check_filename(raw: str) -> str:
    """The name a create gives, as stored: refused (400) when it holds a character no name
    may hold or is too long, else its last path component without invisible characters."""
    if len(raw) > MAX_FILENAME_CHARS:
        raise invalid_request(
            f"Invalid value for 'filename': it is {len(raw)} characters long; at most "
            f"{MAX_FILENAME_CHARS} are taken.",
            "filename",
        )
    for i, ch in enumerate(raw):
        if unicodedata.category(ch) in _FORBIDDEN_IN_NAMES:
            raise invalid_request(
                f"Invalid value for 'filename': character {i} is U+{ord(ch):04X}, which a file "
                "name cannot hold (control characters, line breaks and lone surrogates).",
                "filename",
            )
    name = clean_filename(raw)
    if not name:
        raise invalid_request("Invalid value for 'filename': it holds no usable name.", "filename")
    return name


def check_mime_type(value: str) -> str:
    """A media type as clients send it (``application/jsonl``, ``text/plain; charset=utf-8``):
    printable ASCII only, as RFC 6838 names are, else 400."""
    if not value or len(value) > MAX_MIME_TYPE_CHARS:
        raise invalid_request(
            f"Invalid value for 'mime_type': it is {len(value)} characters long; a media type "
            f"has 1 to {MAX_MIME_TYPE_CHARS}.",
            "mime_type",
        )
    for i, ch in enumerate(value):
        if not " " <= ch <= "~":
            raise invalid_request(
                f"Invalid value for 'mime_type': character {i} is U+{ord(ch):04X}; a media type "
                "is printable ASCII (such as 'application/jsonl').",
                "mime_type",
            )
    return value


def create(
    session: Session,
    caller: Caller,
    settings: Settings,
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
    limit = settings.max_chunked_upload_bytes
    if not 0 < size <= limit:
        raise invalid_request(
            f"Invalid value for 'bytes': {size}; an upload holds from 1 to {limit} bytes "
            "(max_chunked_upload_bytes).",
            "bytes",
        )
    name = check_filename(filename)
    mime_type = check_mime_type(mime_type)
    created = now()
    row = Upload(
        id=new_upload_id(),
        tenant=caller.tenant,
        filename=name,
        purpose=purpose,
        mime_type=mime_type,
        bytes=size,
        status=PENDING,
        created_at=created,
        expires_at=created + UPLOAD_LIFETIME,
        part_count=0,
        received_bytes=0,
    )
    session.add(row)
    session.commit()
    return row


def _too_many_parts(row: Upload, max_parts: int) -> APIError:
    return invalid_request(
        f"Upload {row.id} already holds {row.part_count} parts, the most one upload may hold "
        f"(max_upload_parts={max_parts}); send larger parts.",
        "data",
        code="too_many_parts",
    )


def over_declared(row: Upload, size: int | None) -> APIError:
    """The 400 of a part that would take the upload's parts past its declared ``bytes``
    (``size``: the part's, None when it was refused before it was all read)."""
    part = "This part" if size is None else f"This part of {size} bytes"
    return invalid_request(
        f"{part} would take upload {row.id} past the {row.bytes} bytes it was created for: its "
        f"parts hold {row.received_bytes} bytes so far, so at most "
        f"{max(0, row.bytes - row.received_bytes)} more fit.",
        "data",
        code="upload_bytes_exceeded",
    )


def admit_part(session: Session, tenant: str, upload: str, max_parts: int) -> Upload:
    """Before a part's body is read: the pending upload, with room for one more part (else
    400). The bytes it has room for bound the body; :func:`add_part` decides."""
    row = pending_upload(session, tenant, upload)
    if row.part_count >= max_parts:
        raise _too_many_parts(row, max_parts)
    return row


def add_part(
    session: Session, tenant: str, upload: str, new_part: str, key: str, size: int,
    max_parts: int,
) -> UploadPart:  # fmt: skip
    """Record a part whose bytes are stored at ``key``: counted on the upload row by one
    conditional UPDATE that requires it to be pending, unexpired, under ``max_parts`` parts
    and with room for ``size`` bytes, and inserted in the same transaction. The row lock
    that UPDATE takes orders it against a complete's or cancel's claim: a part either
    commits before the claim (and the claim sees it) or is refused (400; the caller deletes
    its bytes)."""
    won = updated(
        session,
        update(Upload)
        .where(
            Upload.id == upload,
            Upload.tenant == tenant,
            Upload.status == PENDING,
            Upload.expires_at > now(),
            Upload.part_count < max_parts,
            Upload.received_bytes + size <= Upload.bytes,
        )
        .values(part_count=Upload.part_count + 1, received_bytes=Upload.received_bytes + size),
    )
    if not won:
        session.rollback()
        row = pending_upload(session, tenant, upload)  # 404, or 400 once not pending
        if row.part_count >= max_parts:
            raise _too_many_parts(row, max_parts)
        raise over_declared(row, size)
    part = UploadPart(id=new_part, upload_id=upload, bytes=size, storage_key=key, created_at=now())
    session.add(part)
    session.commit()
    return part


def cancel(session: Session, storage: Storage, tenant: str, upload: str, lease_s: float) -> Upload:
    row = get_upload(session, tenant, upload)
    if row.status == COMPLETING:
        release_stale_claim(session, storage, row.id, lease_s)
        session.refresh(row)
    if row.status != COMPLETING:
        row = pending_upload(session, tenant, upload)
    if row.status == COMPLETING or not _move(session, row.id, PENDING, CANCELLED):
        session.refresh(row)
        if row.status == COMPLETING:
            raise APIError(409, f"Upload {row.id} is being completed; it cannot be cancelled.")
        pending_upload(session, tenant, upload)  # raises: it is no longer pending
    session.refresh(row)
    drop_parts(session, storage, row.id)
    return row


def _named_parts(session: Session, row: Upload, part_ids: list[str]) -> list[UploadPart]:
    """The parts ``part_ids`` names, in its order; 400 unless each is a part of the upload
    and together they hold the declared size."""
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
    return [parts[p] for p in part_ids]


class _Claim:
    """A complete's claim on an upload: renewed at least every quarter of the lease while the
    parts are joined; a renewal that finds the claim gone (given back as stale) stops the
    join."""

    def __init__(self, session: Session, upload: str, file_id: str, lease_s: float) -> None:
        self.session = session
        self.upload = upload
        self.file_id = file_id
        self.every_s = lease_s / 4
        self.due = time.monotonic() + self.every_s

    def renew(self) -> None:
        if time.monotonic() < self.due:
            return
        held = updated(
            self.session,
            update(Upload)
            .where(
                Upload.id == self.upload,
                Upload.status == COMPLETING,
                Upload.file_id == self.file_id,
            )
            .values(completing_since=now()),
        )
        self.session.commit()
        if not held:
            raise self.lost()
        self.due = time.monotonic() + self.every_s

    def lost(self) -> APIError:
        return APIError(
            409,
            f"Upload {self.upload}: this complete held it longer than upload_complete_lease_s "
            "without renewing its claim, and the upload was given back; complete it again.",
            code="upload_claim_lost",
        )


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
    its size against the one declared and its MD5 against ``md5``, and complete the upload.

    The upload is claimed first (``completing``, with the id of the file to write), so no part
    is added while the parts are read and joined. The file row and ``completed`` commit in one
    transaction, conditional on the claim still being this call's: a complete that dies, or
    that lost its claim, leaves no file row, only an object that whoever gives the claim back
    deletes."""
    lease_s = settings.upload_complete_lease_s
    row = get_upload(session, tenant, upload)
    if row.status == COMPLETING:
        if not release_stale_claim(session, storage, row.id, lease_s):
            raise APIError(
                409,
                f"Upload {row.id} is already being completed; if that complete died, the upload "
                f"can be completed again {lease_s:g} seconds after it stopped "
                "(upload_complete_lease_s).",
                code="upload_completing",
            )
        session.refresh(row)
    row = pending_upload(session, tenant, upload)
    _named_parts(session, row, part_ids)  # refuse a wrong list before claiming anything
    new_id = file_id()
    claimed = updated(
        session,
        update(Upload)
        .where(Upload.id == row.id, Upload.status == PENDING, Upload.expires_at > now())
        .values(status=COMPLETING, file_id=new_id, completing_since=now()),
    )
    session.commit()
    if not claimed:
        session.refresh(row)
        pending_upload(session, tenant, upload)  # raises when it stopped being pending
        raise APIError(409, f"Upload {row.id} is already being completed or cancelled.")
    key = file_key(new_id)
    claim = _Claim(session, row.id, new_id, lease_s)
    try:
        session.refresh(row)
        named = _named_parts(session, row, part_ids)  # no part can come any more
        join_parts(storage, key, [p.storage_key for p in named], md5, renew=claim.renew)
        file_row = files.new_file_row(
            tenant, new_id, row.purpose, row.filename, row.bytes, key, settings.file_expiry_s
        )
        session.add(file_row)
        done = updated(
            session,
            update(Upload)
            .where(Upload.id == row.id, Upload.status == COMPLETING, Upload.file_id == new_id)
            .values(status=COMPLETED, completing_since=None),
        )
        if not done:
            raise claim.lost()
        session.commit()
    except BaseException:
        session.rollback()
        _give_back(session, row.id, new_id)  # the client may complete it again
        try:
            storage.delete(key)
        except Exception:
            log.exception("upload %s: could not delete %s", row.id, key)
        raise
    metrics.UPLOADS.inc()
    metrics.UPLOAD_BYTES.inc(file_row.bytes)
    session.refresh(row)
    drop_parts(session, storage, row.id)
    return row, file_row


def _move(session: Session, upload: str, expected: str, status: str) -> bool:
    """Move the upload from ``expected`` to ``status`` in one conditional UPDATE."""
    won = updated(
        session,
        update(Upload).where(Upload.id == upload, Upload.status == expected).values(status=status),
    )
    session.commit()
    return bool(won)


def _give_back(session: Session, upload: str, claimed_file: str) -> None:
    """Return an upload this complete claimed (and only if the claim is still its) to
    pending."""
    try:
        updated(
            session,
            update(Upload)
            .where(Upload.id == upload, Upload.status == COMPLETING, Upload.file_id == claimed_file)
            .values(status=PENDING, file_id=None, completing_since=None),
        )
        session.commit()
    except Exception:  # the lease gives it back later
        session.rollback()
        log.exception("upload %s: could not give back the claim of a failed complete", upload)


def join_parts(
    storage: Storage,
    key: str,
    sources: list[str],
    md5: str | None,
    *,
    renew: Callable[[], None] | None = None,
) -> None:
    """Write the ``sources`` one after another to ``key``, a chunk at a time; if ``md5`` is
    given and differs, leave the writer by an exception, which discards the object.
    ``renew`` runs after each chunk (it may raise to stop the join)."""
    digest = hashlib.md5(usedforsecurity=False)
    with storage.writer(key) as out:
        for source in sources:
            for chunk in storage.iter_chunks(source):
                digest.update(chunk)
                out.write(chunk)
                if renew is not None:
                    renew()
        if md5 is not None and digest.hexdigest() != md5.strip().lower():
            raise invalid_request(
                f"The MD5 of the joined parts is {digest.hexdigest()}, not {md5}.", "md5"
            )
