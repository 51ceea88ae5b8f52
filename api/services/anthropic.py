"""Anthropic Message Batches on the batch pipeline: create, look up, list, cancel, delete, and
the results in request order.

A message batch's servable requests are written as an ordinary ``/v1/chat/completions`` input
file and run as an ordinary batch (``batch_id``): tenancy, quotas, priorities, windows and
webhooks apply unchanged. The requests that cannot be served are ``errored`` results decided
at create, kept by position so that the results come back in the order they were sent.
"""

from __future__ import annotations

import codecs
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import BODY_UNREADABLE, JSON_INVALID, APIError, invalid_request, not_found
from api.log_context import bind_batch
from api.schemas import BatchCreate
from api.services import batches, files
from api.services.lookups import could_be_id, keyset_page
from core.batches.ids import file_id, message_batch_id
from core.batchfile import anthropic
from core.batchfile.reader import LineValidator, RawLine, iter_lines
from core.batchfile.request import CHAT_URL, LineError
from core.batchfile.results import dumps_line
from core.batchfile.streamed_json import JsonReader
from core.database.lifecycle import BatchStatus, now
from core.database.tables import Batch, MessageBatch
from core.llms import specs
from core.settings import Settings
from core.storage.base import ObjectNotFound, Storage

#: Anthropic's batches end within 24 hours.
WINDOW = "24h"
ENDED = {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
#: No result line the service writes comes near this (it bounds one line's buffer).
RESULT_LINE_BYTES = 256 * 1024 * 1024
COUNT_NAMES = ("processing", "succeeded", "errored", "canceled", "expired")
COPY_BYTES = 1024 * 1024


def _rfc3339(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _requests_required() -> APIError:
    return invalid_request(
        "requests: Field required (an array of {custom_id, params}).", "requests"
    )


def _request_problem(i: int, request: Any, seen: dict[str, int]) -> APIError | None:
    """Why request ``i`` makes the whole create a 400, or None."""
    if not isinstance(request, dict):
        return invalid_request(f"requests.{i}: expected an object.", f"requests.{i}")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not anthropic.CUSTOM_ID_PATTERN.fullmatch(custom_id):
        return invalid_request(
            f"requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$.",
            f"requests.{i}.custom_id",
        )
    if custom_id in seen:
        return invalid_request(
            f"requests.{i}.custom_id: {custom_id!r} is already the custom_id of request "
            f"{seen[custom_id]}; custom_id must be unique within a batch.",
            f"requests.{i}.custom_id",
        )
    if "params" not in request:
        return invalid_request(f"requests.{i}.params: Field required", f"requests.{i}.params")
    return None


def _text(body: BinaryIO) -> Callable[[int], str]:
    """``body`` read as text the way ``json.loads`` reads bytes (UTF-8, -16 or -32 by its first
    bytes, lone surrogates let through), a piece at a time."""
    head = body.read(4)
    decoder = codecs.getincrementaldecoder(json.detect_encoding(head))("surrogatepass")
    pending = decoder.decode(head)

    def read(chars: int) -> str:
        nonlocal pending
        text, pending = pending, ""
        while not text:
            data = body.read(chars)
            text = decoder.decode(data, final=not data)
            if not data:
                break
        return text

    return read


class _Intake:
    """One pass over a create's body, spooled to a file: each request checked as it is read,
    and the servable ones written to ``lines`` as chat lines, the others kept as errored
    results by position. The answer is the one the whole body, parsed, would get: which 400
    wins when several apply does not depend on where the requests are in the body, and
    ``requests`` named twice counts once, the last time (as ``json.loads`` reads it)."""

    def __init__(self, settings: Settings, limit: int, lines: BinaryIO) -> None:
        self.settings = settings
        self.limit = limit
        self.lines = lines
        self.has_requests = False
        self.extra: str | None = None  # the first, in sorted order, of the other members
        self._start()

    def _start(self) -> None:
        self.count = 0
        self.custom_ids: list[str] = []
        self.seen: dict[str, int] = {}
        self.unservable: dict[str, Any] = {}
        self.problem: APIError | None = None
        self.failure: Exception | None = None  # converting a request failed unexpectedly
        self.written = 0
        self.lines.seek(0)
        self.lines.truncate()
        served = [m for m, spec in self.settings.models.items() if specs.serves(spec, CHAT_URL)]
        self.validator = LineValidator(
            endpoint=CHAT_URL,
            served_models=served,
            max_requests=anthropic.MAX_REQUESTS,
            forwarded=specs.forwarded_models(self.settings.models),
            engine_models=specs.engine_models(self.settings.models),
        )

    def read(self, body: BinaryIO | None) -> None:
        """Read the body (None: the request had no JSON body), or a 400 saying why not."""
        if body is None:
            raise _requests_required()
        try:
            self._walk(JsonReader(_text(body)))
        except json.JSONDecodeError as error:
            raise invalid_request(JSON_INVALID) from error
        except UnicodeDecodeError as error:
            raise invalid_request(BODY_UNREADABLE) from error
        if not self.has_requests:
            raise _requests_required()
        if self.extra is not None:
            raise invalid_request(f"{self.extra}: Extra inputs are not permitted", self.extra)
        if not self.count:
            raise invalid_request("requests: at least one request is required.", "requests")
        if self.count > self.limit:
            raise invalid_request(
                f"requests: at most {self.limit} requests per batch, got {self.count}.",
                "requests",
            )
        if self.problem is not None:
            raise self.problem
        if self.failure is not None:
            raise self.failure

    def _walk(self, reader: JsonReader) -> None:
        if reader.peek() != "{":
            reader.value()
            reader.end()
            return
        for name in reader.members():
            if name != "requests":
                self.extra = name if self.extra is None else min(self.extra, name)
                reader.value()
                continue
            self._start()
            self.has_requests = reader.peek() == "["
            if not self.has_requests:
                reader.value()
                continue
            for request in reader.items():
                self._add(request)
        reader.end()

    def _add(self, request: Any) -> None:
        i = self.count
        self.count += 1
        if self.problem is not None or self.count > self.limit:
            return  # the create is refused: the rest is only counted (and parsed)
        self.problem = _request_problem(i, request, self.seen)
        if self.problem is not None:
            return
        custom_id = request["custom_id"]
        self.custom_ids.append(custom_id)
        self.seen[custom_id] = i
        if self.failure is None:
            try:
                self._convert(i, custom_id, request["params"])
            except Exception as error:  # raised once the body is known to have no 400
                self.failure = error

    def _convert(self, i: int, custom_id: str, params: Any) -> None:
        """Request ``i`` as a chat line, checked as the batch's validation will check it (so
        that no line fails the batch), or an errored result naming why not."""
        try:
            line = dumps_line(anthropic.chat_line(custom_id, anthropic.chat_body(params)))
            number = self.validator.request_lines + 1
            self.validator.check(RawLine(number, self.written, len(line), line[:-1]))
        except anthropic.UnservableRequest as error:
            self.unservable[str(i)] = {"type": "invalid_request_error", "message": error.message}
            return
        except LineError as error:
            param = anthropic.messages_param(error.param)
            message = error.message if param is None else f"{param}: {error.message}"
            self.unservable[str(i)] = {"type": "invalid_request_error", "message": message}
            return
        self.lines.write(line)
        self.written += len(line)


def create(
    session: Session, settings: Settings, storage: Storage, caller: Caller, body: BinaryIO | None
) -> MessageBatch:
    """A message batch from a create's JSON body (a file, read one request at a time; None
    when the request had no JSON body)."""
    limit = min(anthropic.MAX_REQUESTS, settings.max_requests_per_batch)
    with tempfile.TemporaryFile(prefix="batchd-message-batch-") as lines:
        intake = _Intake(settings, limit, lines)
        intake.read(body)
        created = now()
        row = MessageBatch(
            id=message_batch_id(),
            tenant=caller.tenant,
            custom_ids=intake.custom_ids,
            unservable=intake.unservable,
            created_at=created,
            expires_at=created + timedelta(hours=24),
        )
        if intake.written:
            lines.seek(0)
            row.batch_id = _start_batch(
                session, settings, storage, caller, lines, intake.written
            ).id
        else:  # nothing to run: every request is an errored result already
            row.ended_at = created
            row.counts = {**dict.fromkeys(COUNT_NAMES, 0), "errored": len(intake.unservable)}
    session.add(row)
    session.commit()
    return row


def _start_batch(
    session: Session,
    settings: Settings,
    storage: Storage,
    caller: Caller,
    lines: BinaryIO,
    size: int,
) -> Batch:
    new_id = file_id()
    key = f"files/{new_id}"
    with storage.writer(key) as out:
        shutil.copyfileobj(lines, out, COPY_BYTES)
    upload = files.new_file_row(
        caller.tenant,
        new_id,
        "batch",
        "message_batch.jsonl",
        size,
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
    from core.database.tables import File

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
