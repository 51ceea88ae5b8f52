"""A retry: a new batch from exactly the parent's input lines that did not succeed.

Which lines: :mod:`core.retry`. They are copied byte for byte (same ``custom_id``s and bodies)
into a new input file of the caller's, and the batch is made by the ordinary create (quotas,
entitlements, the validate task), with ``metadata.retry_of`` naming the parent.
"""

from __future__ import annotations

import json
import logging

from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request
from api.schemas import MAX_METADATA_PAIRS, BatchCreate, ExpiresAfter, RetryCreate
from api.services.batches import create_batch, get_batch_row
from api.services.files import is_expired, new_file_row
from core.auth import priority_allowed
from core.batchfile import custom_id_in, iter_lines
from core.ids import file_id
from core.lifecycle import TERMINAL
from core.models import Batch, File
from core.retry import RETRY_KINDS, RETRY_OF, retry_kind
from core.settings import Settings
from core.storage import Storage

log = logging.getLogger("batchd.api")


def _conflict(message: str, code: str) -> APIError:
    return APIError(409, message, code=code, headers={"x-should-retry": "false"})


def _live_file(session: Session, file_id_: str | None) -> File | None:
    row = session.get(File, file_id_) if file_id_ else None
    return None if row is None or is_expired(row) else row


def _ids_to_retry(storage: Storage, error_file: File, include: set[str]) -> set[str]:
    """The ``custom_id``s of the error file's lines of the kinds in ``include``."""
    wanted: set[str] = set()
    with storage.reader(error_file.storage_key) as stream:
        for raw in stream:
            if not raw.strip():
                continue
            line = json.loads(raw)
            custom_id = line.get("custom_id")
            if isinstance(custom_id, str) and retry_kind(line) in include:
                wanted.add(custom_id)
    return wanted


def _copy_lines(
    storage: Storage, source: File, key: str, custom_ids: set[str], max_line_bytes: int
) -> tuple[int, int]:
    """Copy the input lines naming ``custom_ids`` to ``key``, byte for byte, in input order;
    (lines, bytes) written. A line over ``max_line_bytes`` is never held whole: the parent's
    validation refused it, so it is passed over."""
    lines = size = 0
    with storage.reader(source.storage_key) as stream, storage.writer(key) as out:
        for raw in iter_lines(stream, max_line_bytes=max_line_bytes):
            custom_id = custom_id_in(raw.data)  # None: a line the parent refused has no say
            if custom_id is not None and custom_id in custom_ids:
                data = raw.data + b"\n"
                out.write(data)
                lines += 1
                size += len(data)
    return lines, size


def _metadata(parent: Batch) -> dict[str, str]:
    metadata = {k: v for k, v in (parent.metadata_ or {}).items() if k != RETRY_OF}
    metadata[RETRY_OF] = parent.id
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(
            f"Batch {parent.id} has {len(metadata) - 1} metadata pairs; its retry carries them "
            f"and '{RETRY_OF}', which would exceed the limit of {MAX_METADATA_PAIRS}.",
            param="metadata",
        )
    return metadata


def retry_batch(
    session: Session,
    storage: Storage,
    caller: Caller,
    settings: Settings,
    batch_id: str,
    body: RetryCreate,
) -> Batch:
    """The retry of the caller's ended batch ``batch_id``: 409 while it runs or once the files
    it needs have expired, 400 when nothing of the kinds asked for failed."""
    parent = get_batch_row(session, caller.tenant, batch_id)
    if parent.status not in TERMINAL:
        raise _conflict(
            f"Batch {batch_id} is still '{parent.status}'; only a batch that has ended can be "
            f"retried (wait for it: batchd wait {batch_id}).",
            "batch_not_finished",
        )
    include = set(body.include or RETRY_KINDS)
    kinds = ", ".join(sorted(include))
    if parent.error_file_id is None:
        raise invalid_request(
            f"Batch {batch_id} has no error lines ({parent.status}): nothing to retry.",
            code="nothing_to_retry",
        )
    error_file = _live_file(session, parent.error_file_id)
    if error_file is None:
        raise _conflict(
            f"The error file {parent.error_file_id} of batch {batch_id} has expired: what "
            "did not succeed is no longer known.",
            "results_expired",
        )
    custom_ids = _ids_to_retry(storage, error_file, include)
    if not custom_ids:
        raise invalid_request(
            f"Batch {batch_id} has no lines of the kinds to retry ({kinds}): nothing to retry. "
            "Errors a request causes itself (4xx) are never retried.",
            param="include" if body.include else None,
            code="nothing_to_retry",
        )
    source = _live_file(session, parent.input_file_id)
    if source is None:
        raise _conflict(
            f"The input file {parent.input_file_id} of batch {batch_id} has expired: its "
            "lines can no longer be read.",
            "input_file_expired",
        )
    new_id = file_id()
    key = f"files/{new_id}"
    lines, size = _copy_lines(storage, source, key, custom_ids, settings.max_line_bytes)
    filename = f"{parent.id}_retry.jsonl"
    row = new_file_row(caller.tenant, new_id, "batch", filename, size, key, settings.file_expiry_s)
    session.add(row)
    session.commit()
    priority = body.priority or parent.priority
    explicit = body.priority is not None or priority_allowed(priority, caller.max_priority)
    create = BatchCreate(
        **({"priority": priority} if explicit else {}),  # an ask above the key's is a 403
        input_file_id=new_id,
        endpoint=parent.endpoint,  # type: ignore[arg-type]
        completion_window=body.completion_window or parent.completion_window,
        metadata=_metadata(parent),
        webhook_url=parent.webhook_url,
        output_expires_after=(
            ExpiresAfter(anchor="created_at", seconds=parent.output_expires_after_s)
            if parent.output_expires_after_s
            else None
        ),
    )
    try:
        retry = create_batch(session, settings, caller, create, key=None)
    except APIError as refused:
        if refused.status_code >= 500:
            raise  # the batch exists (failed): its input stays
        # Refused (a quota, an entitlement): the copy made for it is not left behind.
        session.rollback()
        session.delete(session.merge(row))
        session.commit()
        storage.delete(key)
        raise
    log.info("batch %s retries %s lines of %s (%s)", retry.id, lines, batch_id, kinds)
    return retry
