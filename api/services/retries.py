"""A retry: a new batch from exactly the parent's input lines that did not succeed.

Which lines: :mod:`core.batches.retry` (the kinds of result, and optionally the line numbers). They
are copied byte for byte (same ``custom_id``s and bodies) into a new input file of the caller's, and
the batch is made by the ordinary create (quotas, entitlements, the validate task), with
``metadata.retry_of`` naming the parent. The create's checks run once before the copy too, so a
refused retry copies nothing; an Idempotency-Key makes a retry once, as it makes a create.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request
from api.schemas import MAX_METADATA_PAIRS, BatchCreate, ExpiresAfter, RetryCreate
from api.services.batches import check_create, create_batch, existing_batch, get_batch_row
from api.services.files import is_expired, new_file_row
from core.batches.ids import file_id
from core.batches.priority import priority_name
from core.batches.retry import (
    RETRY_KINDS,
    RETRY_OF,
    LineSelection,
    describe_lines,
    name_lines,
    retry_kind,
)
from core.batchfile.reader import custom_id_in, iter_lines
from core.database.auth import priority_allowed
from core.database.lifecycle import TERMINAL
from core.database.tables import Batch, File
from core.settings import Settings
from core.storage.base import Storage

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
    storage: Storage,
    parent: Batch,
    source: File,
    key: str,
    custom_ids: set[str],
    lines: LineSelection | None,
    max_line_bytes: int,
    kinds: str,
) -> tuple[int, int]:
    """Copy the input lines naming ``custom_ids`` (of those in ``lines``, if given) to ``key``,
    byte for byte, in input order; (lines, bytes) written. Each line is read with the bound
    upload validation uses, ``max_line_bytes``: a line over it is never held whole, and when
    it may be one to retry, the retry is refused naming it (a 400, nothing stored). So is a
    line asked for by number that is blank, past the end or cannot be read."""
    param = "lines" if lines is not None else None
    copied: set[str] = set()
    found: set[str] = set()  # wanted ids seen on readable lines, selected or not
    too_long: list[int] = []  # lines over the bound that may be wanted (their id is unknown)
    unreadable: list[int] = []  # lines asked for on their own that name no custom_id
    singles_seen: set[int] = set()
    last_line = lines_out = size = 0
    with storage.reader(source.storage_key) as stream, storage.writer(key) as out:
        for raw in iter_lines(stream, max_line_bytes=max_line_bytes):
            last_line = raw.line
            selected = lines is None or raw.line in lines
            if lines is not None and raw.line in lines.singles:
                singles_seen.add(raw.line)
            if raw.too_long:
                if selected:
                    too_long.append(raw.line)
                continue
            custom_id = custom_id_in(raw.data)  # None: not JSON, nested too deep, not a string
            if custom_id is None:
                if lines is not None and raw.line in lines.singles:
                    unreadable.append(raw.line)
                continue
            if custom_id in custom_ids:
                found.add(custom_id)
            if selected and custom_id in custom_ids and custom_id not in copied:
                data = raw.data + b"\n"
                out.write(data)
                copied.add(custom_id)
                lines_out += 1
                size += len(data)
        if lines is not None and (past := lines.past(last_line)):
            raise invalid_request(
                f"Invalid value for 'lines': {name_lines(past)} "
                f"{'is' if len(past) == 1 else 'are'} past the end of the input file "
                f"{source.id} of batch {parent.id}, whose last line is {last_line}.",
                param=param,
                code="lines_out_of_range",
            )
        if lines is not None and (blank := sorted(lines.singles - singles_seen)):
            raise invalid_request(
                f"Invalid value for 'lines': line {name_lines(blank)} of the input file "
                f"{source.id} of batch {parent.id} {'is' if len(blank) == 1 else 'are'} blank: "
                "no request to retry.",
                param=param,
                code="line_blank",
            )
        if unreadable:
            raise invalid_request(
                f"Line {name_lines(unreadable)} of the input file {source.id} of batch "
                f"{parent.id} names no custom_id a retry can read (not a JSON object, nested "
                "too deeply, or a custom_id that is not a string); it cannot be retried.",
                param=param,
                code="line_unreadable",
            )
        # Each wanted custom_id is on a line that could be read, unless that line is over the
        # bound now (it was lowered since the parent ran): then the retry cannot be whole.
        asked_singly = [n for n in too_long if lines is not None and n in lines.singles]
        if too_long and (asked_singly or len(found) < len(custom_ids)):
            named = asked_singly or too_long
            raise invalid_request(
                f"Line {name_lines(named)} of the input file {source.id} of batch {parent.id} "
                f"is longer than {max_line_bytes} bytes, the limit for one line "
                "(max_line_bytes); a retry cannot copy it.",
                param=param,
                code="line_too_long",
            )
        if lines_out == 0:
            raise invalid_request(
                f"None of the lines {name_lines([describe_lines(*i) for i in lines.items])} "
                f"of batch {parent.id} has a result of the kinds to retry ({kinds}): nothing "
                "to retry."
                if lines is not None
                else f"Batch {parent.id} has no lines of the kinds to retry ({kinds}): nothing "
                "to retry.",
                param=param,
                code="nothing_to_retry",
            )
    return lines_out, size


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


def _selection(items: list[int | tuple[int, int]]) -> LineSelection:
    for item in items:
        if isinstance(item, tuple) and item[0] > item[1]:
            raise invalid_request(
                f"Invalid value for 'lines': the range [{item[0]}, {item[1]}] ends before it "
                "starts.",
                param="lines",
            )
    return LineSelection(items)


def _request(parent: Batch, body: RetryCreate, lines: LineSelection | None) -> dict[str, Any]:
    """What a retry asks for, spelled one way: the same ask compares equal."""
    return {
        "retry_of": parent.id,
        "include": sorted(set(body.include or RETRY_KINDS)),
        "lines": None if lines is None else lines.normalized(),
        "completion_window": body.completion_window,
        "priority": body.priority,
        "max_total_tokens": body.max_total_tokens,
    }


def _replay(row: Batch, request: dict[str, Any]) -> Batch:
    """The answer to a retry that repeats an idempotency key: the retry that key made, as it
    is now, when asked for the same; else (another parent or selection, or a key a create
    used) a 409 naming the difference."""
    asked = row.retry_request
    differs: str | None
    if asked is None:
        differs = "request: it was not a retry"
    else:
        differs = next((name for name, value in request.items() if asked.get(name) != value), None)
        if differs is None:
            return row
        if differs == "retry_of":
            differs = f"parent batch ({asked.get('retry_of')})"
    raise APIError(
        409,
        f"The idempotency key was already used for batch {row.id} with another {differs}; "
        "use a new key for a different retry.",
        param="idempotency_key",
        code="idempotency_key_reused",
        headers={"x-should-retry": "false"},
    )


def _create_body(
    parent: Batch, body: RetryCreate, caller: Caller, input_file_id: str
) -> BatchCreate:
    priority = body.priority or priority_name(parent.priority)
    explicit = body.priority is not None or priority_allowed(priority, caller.max_priority)
    return BatchCreate(
        **({"priority": priority} if explicit else {}),  # an ask above the key's is a 403
        input_file_id=input_file_id,
        endpoint=parent.endpoint,  # type: ignore[arg-type]
        completion_window=body.completion_window or parent.completion_window,
        metadata=_metadata(parent),
        webhook_url=parent.webhook_url,
        max_total_tokens=body.max_total_tokens,
        output_expires_after=(
            ExpiresAfter(anchor="created_at", seconds=parent.output_expires_after_s)
            if parent.output_expires_after_s
            else None
        ),
    )


def _forget_copy(session: Session, storage: Storage, row: File) -> None:
    session.rollback()
    session.delete(session.merge(row))
    session.commit()
    storage.delete(row.storage_key)


def retry_batch(
    session: Session,
    storage: Storage,
    caller: Caller,
    settings: Settings,
    batch_id: str,
    body: RetryCreate,
    key: str | None = None,
) -> Batch:
    """The retry of the caller's ended batch ``batch_id``: 409 while it runs or once the files
    it needs have expired, 400 when nothing of the kinds asked for failed. With an idempotency
    ``key`` the tenant already used, the retry that key made (409 if it asked for another).
    Quotas and entitlements are checked before the parent's lines are copied."""
    parent = get_batch_row(session, caller.tenant, batch_id)
    lines = None if body.lines is None else _selection(body.lines)
    request = _request(parent, body, lines)
    if key is not None and (existing := existing_batch(session, caller.tenant, key)) is not None:
        return _replay(existing, request)
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
    # Refused (an entitlement, the quota): before a byte is copied.
    check_create(session, settings, caller, _create_body(parent, body, caller, source.id))
    new_id = file_id()
    object_key = f"files/{new_id}"
    count, size = _copy_lines(
        storage, parent, source, object_key, custom_ids, lines, settings.max_line_bytes, kinds
    )
    filename = f"{parent.id}_retry.jsonl"
    row = new_file_row(
        caller.tenant, new_id, "batch", filename, size, object_key, settings.file_expiry_s
    )
    session.add(row)
    session.commit()
    create = _create_body(parent, body, caller, new_id)
    try:
        retry = create_batch(
            session, settings, caller, create, key,
            replay=lambda existing: _replay(existing, request),
            retry_request=request if key is not None else None,
        )  # fmt: skip
    except APIError as refused:
        if refused.status_code >= 500:
            raise  # the batch exists (failed): its input stays
        # Refused (the quota, filled meanwhile): the copy made for it is not left behind.
        _forget_copy(session, storage, row)
        raise
    if retry.input_file_id != new_id:
        # The same key's retry, made meanwhile by a concurrent call, is the answer.
        _forget_copy(session, storage, row)
        return retry
    log.info("batch %s retries %s lines of %s (%s)", retry.id, count, batch_id, kinds)
    return retry
