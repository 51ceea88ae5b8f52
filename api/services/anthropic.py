"""Anthropic Message Batches on the batch pipeline: create, look up, list, cancel, delete, and
the results in request order.

A message batch's servable requests are written as an ordinary ``/v1/chat/completions`` input
file and run as an ordinary batch (``batch_id``): tenancy, quotas, priorities, windows and
webhooks apply unchanged. The requests that cannot be served are ``errored`` results decided
at create, kept by position so that the results come back in the order they were sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request, not_found
from api.log_context import bind_batch
from api.schemas import BatchCreate
from api.services import batches, files
from api.services.common import could_be_id, keyset_page
from core.batchfile import anthropic
from core.batchfile.reader import LineValidator, RawLine, iter_lines
from core.batchfile.request import CHAT_URL, LineError
from core.batchfile.results import dumps_line
from core.ids import file_id, message_batch_id
from core.lifecycle import BatchStatus, now
from core.llms import specs
from core.settings import Settings
from core.storage.base import ObjectNotFound, Storage
from core.tables import Batch, MessageBatch

#: Anthropic's batches end within 24 hours.
WINDOW = "24h"
ENDED = {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
#: No result line the service writes comes near this (it bounds one line's buffer).
RESULT_LINE_BYTES = 256 * 1024 * 1024
COUNT_NAMES = ("processing", "succeeded", "errored", "canceled", "expired")


def _rfc3339(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _checked_requests(body: Any, limit: int) -> list[dict[str, Any]]:
    """The body's ``requests``, each with a valid and unique ``custom_id`` (400 otherwise)."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list):
        raise invalid_request(
            "requests: Field required (an array of {custom_id, params}).", "requests"
        )
    requests = body["requests"]
    extra = sorted(set(body) - {"requests"})
    if extra:
        raise invalid_request(f"{extra[0]}: Extra inputs are not permitted", extra[0])
    if not requests:
        raise invalid_request("requests: at least one request is required.", "requests")
    if len(requests) > limit:
        raise invalid_request(
            f"requests: at most {limit} requests per batch, got {len(requests)}.", "requests"
        )
    seen: dict[str, int] = {}
    for i, request in enumerate(requests):
        if not isinstance(request, dict):
            raise invalid_request(f"requests.{i}: expected an object.", f"requests.{i}")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not anthropic.CUSTOM_ID_PATTERN.fullmatch(custom_id):
            raise invalid_request(
                f"requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$.",
                f"requests.{i}.custom_id",
            )
        if custom_id in seen:
            raise invalid_request(
                f"requests.{i}.custom_id: {custom_id!r} is already the custom_id of request "
                f"{seen[custom_id]}; custom_id must be unique within a batch.",
                f"requests.{i}.custom_id",
            )
        seen[custom_id] = i
        if "params" not in request:
            raise invalid_request(f"requests.{i}.params: Field required", f"requests.{i}.params")
    return requests


def _input_lines(
    settings: Settings, requests: list[dict[str, Any]]
) -> tuple[bytes, dict[str, Any]]:
    """The chat input file of the servable requests, and the errored ones by position. Each
    line is checked as the batch's validation will check it, so no line fails the batch."""
    served = [m for m, spec in settings.models.items() if specs.serves(spec, CHAT_URL)]
    validator = LineValidator(
        endpoint=CHAT_URL,
        served_models=served,
        max_requests=anthropic.MAX_REQUESTS,
        forwarded=specs.forwarded_models(settings.models),
    )
    data = bytearray()
    unservable: dict[str, Any] = {}
    for i, request in enumerate(requests):
        try:
            line = dumps_line(
                anthropic.chat_line(request["custom_id"], anthropic.chat_body(request["params"]))
            )
            validator.check(RawLine(validator.request_lines + 1, len(data), len(line), line[:-1]))
        except anthropic.UnservableRequest as error:
            unservable[str(i)] = {"type": "invalid_request_error", "message": error.message}
            continue
        except LineError as error:
            param = anthropic.messages_param(error.param)
            message = error.message if param is None else f"{param}: {error.message}"
            unservable[str(i)] = {"type": "invalid_request_error", "message": message}
            continue
        data += line
    return bytes(data), unservable


def create(
    session: Session, settings: Settings, storage: Storage, caller: Caller, body: Any
) -> MessageBatch:
    requests = _checked_requests(body, min(anthropic.MAX_REQUESTS, settings.max_requests_per_batch))
    data, unservable = _input_lines(settings, requests)
    created = now()
    row = MessageBatch(
        id=message_batch_id(),
        tenant=caller.tenant,
        custom_ids=[r["custom_id"] for r in requests],
        unservable=unservable,
        created_at=created,
        expires_at=created + timedelta(hours=24),
    )
    if data:
        row.batch_id = _start_batch(session, settings, storage, caller, data).id
    else:  # nothing to run: every request is an errored result already
        row.ended_at = created
        row.counts = {**dict.fromkeys(COUNT_NAMES, 0), "errored": len(unservable)}
    session.add(row)
    session.commit()
    return row


def _start_batch(
    session: Session, settings: Settings, storage: Storage, caller: Caller, data: bytes
) -> Batch:
    new_id = file_id()
    key = f"files/{new_id}"
    with storage.writer(key) as out:
        out.write(data)
    upload = files.new_file_row(
        caller.tenant,
        new_id,
        "batch",
        "message_batch.jsonl",
        len(data),
        key,
        settings.file_expiry_s,
    )
    files.record_upload(settings.database_url, storage, upload)
    request = BatchCreate(input_file_id=new_id, endpoint=CHAT_URL, completion_window=WINDOW)
    try:
        return batches.create_batch(session, settings, caller, request, None)
    except BaseException:
        files.delete_file(session, storage, caller.tenant, new_id)
        raise


def get_row(session: Session, tenant: str, batch_id: str) -> MessageBatch:
    row = session.get(MessageBatch, batch_id) if could_be_id(batch_id) else None
    if row is None or row.tenant != tenant:
        raise not_found("MessageBatch", batch_id)
    if row.batch_id is not None:
        bind_batch(row.batch_id)
    return row


@dataclass
class View:
    """What a message batch shows: its row, the batch that runs it, and its counts."""

    row: MessageBatch
    batch: Batch | None
    status: str
    counts: dict[str, int] = field(default_factory=dict)

    def public(self, base_url: str) -> dict[str, Any]:
        row = self.row
        ended = self.status == "ended"
        return {
            "id": row.id,
            "type": "message_batch",
            "processing_status": self.status,
            "request_counts": self.counts,
            "ended_at": _rfc3339(row.ended_at),
            "created_at": _rfc3339(row.created_at),
            "expires_at": _rfc3339(row.expires_at),
            "archived_at": None,
            "cancel_initiated_at": _rfc3339(row.cancel_initiated_at),
            "results_url": f"{base_url}v1/messages/batches/{row.id}/results" if ended else None,
        }


def _ended_at(batch: Batch) -> datetime:
    return batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at or now()


def view(session: Session, storage: Storage, row: MessageBatch) -> View:
    """The batch as it stands; the first look after it ended counts its results once."""
    batch = session.get(Batch, row.batch_id) if row.batch_id is not None else None
    if row.counts is not None:
        return View(row, batch, "ended", row.counts)
    if batch is None or batch.status in ENDED:
        counts = dict.fromkeys(COUNT_NAMES, 0)
        for line in results(session, storage, row):
            counts[json.loads(line)["result"]["type"]] += 1
        row.counts = counts
        row.ended_at = _ended_at(batch) if batch is not None else now()
        session.commit()
        return View(row, batch, "ended", counts)
    succeeded, failed = batch.request_completed, batch.request_failed + len(row.unservable)
    counts = {
        "processing": max(len(row.custom_ids) - succeeded - failed, 0),
        "succeeded": succeeded,
        "errored": failed,
        "canceled": 0,
        "expired": 0,
    }
    status = "canceling" if batch.status == BatchStatus.CANCELLING else "in_progress"
    return View(row, batch, status, counts)


def list_rows(
    session: Session, tenant: str, before_id: str | None, after_id: str | None, limit: int
) -> tuple[list[MessageBatch], bool]:
    """A page of the tenant's message batches, newest first: those after ``after_id`` (older
    ones), or those before ``before_id`` (newer ones)."""
    if before_id is not None and after_id is not None:
        raise invalid_request("Pass before_id or after_id, not both.", "before_id")
    query = select(MessageBatch).where(MessageBatch.tenant == tenant)
    name, cursor_id = ("before_id", before_id) if before_id is not None else ("after_id", after_id)
    cursor = None
    if cursor_id is not None:
        cursor = session.get(MessageBatch, cursor_id) if could_be_id(cursor_id) else None
        if cursor is None or cursor.tenant != tenant:
            raise invalid_request(f"{name}: no such message batch: {cursor_id}", name)
    if before_id is not None:
        rows, has_more = keyset_page(
            session, query, MessageBatch, cursor, descending=False, limit=limit
        )
        return rows[::-1], has_more
    return keyset_page(session, query, MessageBatch, cursor, descending=True, limit=limit)


def cancel(session: Session, storage: Storage, row: MessageBatch) -> View:
    current = view(session, storage, row)
    if current.status == "ended":
        raise invalid_request(f"Message batch {row.id} has ended; it cannot be canceled.")
    if current.status == "in_progress" and row.batch_id is not None:
        batches.cancel_batch(session, row.tenant, row.batch_id)
        row.cancel_initiated_at = now()
        session.commit()
    return view(session, storage, row)


def delete(session: Session, storage: Storage, row: MessageBatch) -> None:
    """Delete an ended message batch, and the batch that ran it with its files: nothing of it
    stays listed under ``/v1/batches`` (its shards and results go with it)."""
    if view(session, storage, row).status != "ended":
        raise invalid_request(
            f"Message batch {row.id} is still being processed; cancel it and wait for it "
            "to end before deleting it."
        )
    batch = session.get(Batch, row.batch_id) if row.batch_id is not None else None
    session.delete(row)
    session.commit()
    if batch is None:
        return
    for kept in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
        if kept is not None:
            with suppress(APIError):  # already deleted, or expired
                files.delete_file(session, storage, row.tenant, kept)
    session.delete(batch)
    session.commit()


def _lines(storage: Storage, key: str | None) -> Iterator[dict[str, Any]]:
    if key is None:
        return
    try:
        chunks = storage.iter_chunks(key)
        for raw in iter_lines(chunks, max_line_bytes=RESULT_LINE_BYTES):
            if raw.data.strip():
                yield json.loads(raw.data)
    except ObjectNotFound:
        return


def _file_key(session: Session, file_id_: str | None) -> str | None:
    from core.tables import File

    row = session.get(File, file_id_) if file_id_ is not None else None
    return None if row is None else row.storage_key


def results(session: Session, storage: Storage, row: MessageBatch) -> Iterator[bytes]:
    """The results, one JSONL line per request in the order they were sent. The batch's
    output and error files are each in input order, so one pass over each merges them."""
    batch = session.get(Batch, row.batch_id) if row.batch_id is not None else None
    out_key = _file_key(session, batch.output_file_id) if batch else None
    err_key = _file_key(session, batch.error_file_id) if batch else None
    failure = "The batch could not be run."
    if batch is not None and batch.errors:
        failure = "; ".join(str(e.get("message")) for e in batch.errors[:3])
    custom_ids, unservable = list(row.custom_ids), dict(row.unservable)

    def generate() -> Iterator[bytes]:
        heads = [_lines(storage, out_key), _lines(storage, err_key)]
        pending: list[dict[str, Any] | None] = [next(h, None) for h in heads]
        for i, custom_id in enumerate(custom_ids):
            result: dict[str, Any] | None = None
            if str(i) in unservable:
                error = unservable[str(i)]
                result = anthropic.errored(error["type"], error["message"])
            for k, line in enumerate(pending):
                if result is None and line is not None and line.get("custom_id") == custom_id:
                    result = anthropic.result_of(line)
                    pending[k] = next(heads[k], None)
            if result is None:
                result = anthropic.errored("api_error", failure)
            yield dumps_line({"custom_id": custom_id, "result": result})

    return generate()
