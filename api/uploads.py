"""Streaming multipart uploads: the file part goes straight from the socket to storage.

Starlette's form parser spools a file into a temporary file before the route runs; here the
body is parsed as it arrives (python-multipart's push parser) and the file part is written
through ``Storage.writer`` in the chunks the server received, so memory stays flat whatever the
upload's size. The writer is entered inside the parse: any error (too large, malformed body,
bad field, client gone, too slow) leaves the block by an exception, so the object never appears.

Slow bodies cannot hold the upload slots: a body that stalls or trickles is cut (408), and one
tenant holds at most ``max_concurrent_uploads_per_tenant`` uploads of a process (429).
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from api.errors import APIError, invalid_request
from core.settings import Settings
from core.storage.base import Storage

#: Room for the multipart framing and the small form fields around the file part.
MULTIPART_OVERHEAD = 64 * 1024
#: The most bytes kept for one non-file form field (purpose, expires_after[...]), and the most
#: such fields one body may hold: the fields are kept in memory, so both are small.
MAX_FIELD_BYTES = 1024
MAX_FORM_FIELDS = 16
#: After rejecting an over-large body, read at most this much more of it so that the client,
#: still sending, gets the 413 instead of a reset connection.
DRAIN_LIMIT = 8 * 1024 * 1024
MAX_FILENAME_CHARS = 255
#: The longest header line of one part (python-multipart's default, 4 KiB, refuses file names
#: that clients do send; the name is cut to MAX_FILENAME_CHARS once received).
MAX_PART_HEADER_BYTES = 32 * 1024

FILE_FIELD = "file"
#: Uploads in progress at once per process (``max_concurrent_uploads``). Each holds a thread
#: while it waits on the network, so uploads get their own limiter instead of starving the pool
#: the other routes run in; further uploads wait (unread) for a slot.
_upload_slots: anyio.CapacityLimiter | None = None
#: Uploads per tenant in this process, waiting for a slot or in one.
_tenant_uploads: Counter[str] = Counter()
_tenant_lock = threading.Lock()


def _slots(size: int) -> anyio.CapacityLimiter:
    global _upload_slots
    if _upload_slots is None:  # created inside the event loop, on first use
        _upload_slots = anyio.CapacityLimiter(size)
    return _upload_slots


@contextmanager
def _tenant_slot(tenant: str, limit: int) -> Iterator[None]:
    """One of the tenant's ``limit`` uploads in this process, else 429: one tenant's slow or
    many uploads cannot take every slot."""
    with _tenant_lock:
        if _tenant_uploads[tenant] >= limit:
            raise APIError(
                429,
                f"This tenant already has {_tenant_uploads[tenant]} uploads in progress, the "
                f"limit (max_concurrent_uploads_per_tenant={limit}); wait for one to finish, "
                "then retry.",
                code="too_many_concurrent_uploads",
                headers={"retry-after": "1", "connection": "close"},
            )
        _tenant_uploads[tenant] += 1
    try:
        yield
    finally:
        with _tenant_lock:
            _tenant_uploads[tenant] -= 1
            if _tenant_uploads[tenant] <= 0:
                del _tenant_uploads[tenant]


class _Pace:
    """How long the next chunk of a body may take: at most ``idle_timeout_s``, and no longer
    than keeps the body's average at ``min_bytes_per_s`` once ``grace_s`` have passed. Only the
    time spent waiting on the client counts (not the time the server spends storing)."""

    def __init__(self, settings: Settings) -> None:
        self.idle_timeout_s = float(settings.upload_idle_timeout_s)
        self.min_bytes_per_s = float(settings.upload_min_bytes_per_s)
        self.grace_s = float(settings.upload_rate_grace_s)
        self.waited_s = 0.0

    def timeout(self, received: int) -> float:
        timeout = self.idle_timeout_s
        if self.min_bytes_per_s > 0:
            allowed = max(self.grace_s, received / self.min_bytes_per_s)
            timeout = min(timeout, allowed - self.waited_s)
        return max(0.0, timeout)

    def too_slow(self, received: int, waited: float) -> APIError:
        if waited >= self.idle_timeout_s:
            message = (
                f"The request body stalled: nothing arrived for {self.idle_timeout_s:g} seconds "
                "(upload_idle_timeout_s), so the upload was dropped; send it again."
            )
            code = "upload_idle_timeout"
        else:
            average = received / max(self.waited_s, 1e-9)
            message = (
                f"The request body arrived at {average:.0f} bytes/s on average, under the "
                f"minimum of {self.min_bytes_per_s:g} bytes/s (upload_min_bytes_per_s) after "
                f"{self.waited_s:.0f} seconds, so the upload was dropped; send it again."
            )
            code = "upload_too_slow"
        return APIError(408, message, code=code, headers={"connection": "close"})


def too_large(limit: int, file_field: str = FILE_FIELD) -> APIError:
    return APIError(
        413,
        f"The uploaded file exceeds the maximum size of {limit} bytes.",
        param=file_field,
        code="file_too_large",
    )


_UNSAFE_FILENAME_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def sanitize_filename(raw: str) -> str:
    """The last path component, without control characters, trimmed; never empty."""
    return clean_filename(raw) or "upload.jsonl"


def clean_filename(raw: str) -> str:
    """The last path component, without control characters, trimmed; empty when nothing
    usable is left."""
    name = raw.replace("\\", "/").rsplit("/", 1)[-1]
    name = unicodedata.normalize("NFC", name)
    name = _UNSAFE_FILENAME_CHARS.sub("", name)
    name = "".join(ch for ch in name if unicodedata.category(ch) not in {"Cc", "Cf", "Zl", "Zp"})
    name = name.strip()
    if name in {".", ".."}:
        name = ""
    if len(name) > MAX_FILENAME_CHARS:
        stem, dot, ext = name.rpartition(".")
        if dot and 0 < len(ext) <= 16:
            name = stem[: MAX_FILENAME_CHARS - len(ext) - 1] + "." + ext
        else:
            name = name[:MAX_FILENAME_CHARS]
    return name


@dataclass
class Upload:
    """What a multipart upload held: the stored file's size and name, and the small fields."""

    bytes: int = 0
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


class _Ingest:
    """python-multipart callbacks that route the file part into a storage writer."""

    def __init__(
        self, stack: ExitStack, storage: Storage, key: str, max_bytes: int, file_field: str
    ) -> None:
        self.stack = stack
        self.file_field = file_field
        self.storage = storage
        self.key = key
        self.max_bytes = max_bytes
        self.result = Upload()
        self.ended = False
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, str] = {}
        self._out: BinaryIO | None = None
        self._in_file = False
        self._field_name: str | None = None
        self._field_value = bytearray()
        self._form_fields = 0

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self._headers = {}
        self._in_file = False
        self._field_name = None
        self._field_value.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        if len(self._header_value) > MAX_PART_HEADER_BYTES:
            raise _header_too_long()

    def on_header_end(self) -> None:
        name = self._header_field.decode("latin-1").strip().lower()
        self._headers[name] = self._header_value.decode("latin-1")
        self._header_field.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get("content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            raise invalid_request(
                "Each multipart part needs a 'Content-Disposition: form-data; name=...' header."
            )
        name = options[b"name"].decode("utf-8", "replace")
        if name == self.file_field:
            if self._out is not None:
                raise invalid_request(f"Send exactly one '{name}' part.", param=self.file_field)
            raw_name = options.get(b"filename", b"").decode("utf-8", "replace")
            self.result.filename = sanitize_filename(raw_name)
            self._out = self.stack.enter_context(self.storage.writer(self.key))
            self._in_file = True
        else:
            self._form_fields += 1
            if self._form_fields > MAX_FORM_FIELDS:
                raise invalid_request(
                    f"The multipart body has more than {MAX_FORM_FIELDS} form fields besides "
                    f"'{self.file_field}'; at most {MAX_FORM_FIELDS} are read.",
                    code="too_many_form_fields",
                )
            self._field_name = name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file and self._out is not None:
            self.result.bytes += end - start
            if self.result.bytes > self.max_bytes:
                raise too_large(self.max_bytes, self.file_field)
            self._out.write(data[start:end])
        elif self._field_name is not None:
            if len(self._field_value) + (end - start) > MAX_FIELD_BYTES:
                raise invalid_request(
                    f"The form field '{self._field_name}' is longer than {MAX_FIELD_BYTES} bytes.",
                    param=self._field_name,
                )
            self._field_value += data[start:end]

    def on_part_end(self) -> None:
        if self._field_name is not None:
            value = self._field_value.decode("utf-8", "replace")
            self.result.fields.setdefault(self._field_name, value)
        self._in_file = False
        self._field_name = None

    def on_end(self) -> None:
        self.ended = True


def _header_too_long() -> APIError:
    return invalid_request(
        f"A multipart part header is longer than {MAX_PART_HEADER_BYTES} bytes "
        "(is the file name that long?).",
        param=FILE_FIELD,
    )


def _parser(boundary: bytes, callbacks: dict[str, Callable[..., None]]) -> MultipartParser:
    try:
        return MultipartParser(
            boundary,
            callbacks,  # type: ignore[arg-type]
            max_header_size=MAX_PART_HEADER_BYTES + 1024,  # the limit above trips first
        )
    except TypeError:  # older python-multipart releases have no header limit of their own
        return MultipartParser(boundary, callbacks)  # type: ignore[arg-type]


def _boundary(request: Request) -> bytes:
    ctype, options = parse_options_header(request.headers.get("content-type"))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise APIError(
            400,
            "Expected a multipart/form-data body with a 'file' part and a 'purpose' field.",
            param=FILE_FIELD,
        )
    return options[b"boundary"]


def check_declared_length(request: Request, max_bytes: int) -> None:
    """Refuse before reading a byte when the declared body cannot fit."""
    declared = request.headers.get("content-length")
    if (
        declared is not None
        and declared.strip().isdigit()
        and int(declared) > max_bytes + MULTIPART_OVERHEAD
    ):
        raise too_large(max_bytes)


async def receive_upload(
    request: Request,
    storage: Storage,
    key: str,
    max_bytes: int,
    finish: Callable[[Upload], None],
    *,
    tenant: str,
    settings: Settings,
    file_field: str = FILE_FIELD,
) -> Upload:
    """Parse the body and stream its file part (the form field ``file_field``) to ``key``.

    ``finish(upload)`` runs (in a worker thread) after the whole body is parsed and before the
    object is committed: raising there (an invalid field) discards the stored bytes.
    """
    check_declared_length(request, max_bytes)
    boundary = _boundary(request)
    stream = request.stream()
    try:
        with _tenant_slot(tenant, settings.max_concurrent_uploads_per_tenant):
            return await _receive(
                stream, boundary, storage, key, max_bytes, finish, settings, file_field
            )
    except APIError as error:
        if error.status_code in (413, 429):
            await _drain(stream, settings.upload_idle_timeout_s)
        raise


async def _receive(
    stream: AsyncIterator[bytes],
    boundary: bytes,
    storage: Storage,
    key: str,
    max_bytes: int,
    finish: Callable[[Upload], None],
    settings: Settings,
    file_field: str,
) -> Upload:
    received = 0
    body_limit = max_bytes + MULTIPART_OVERHEAD
    pace = _Pace(settings)

    async def next_chunk() -> bytes | None:
        nonlocal received
        timeout = pace.timeout(received)
        started = anyio.current_time()
        with anyio.move_on_after(timeout) as waiting:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                return None
            finally:
                pace.waited_s += anyio.current_time() - started
        if waiting.cancelled_caught:
            raise pace.too_slow(received, anyio.current_time() - started)
        received += len(chunk)
        if received > body_limit:
            raise too_large(max_bytes, file_field)
        return chunk

    def ingest(receive: Callable[[], Coroutine[Any, Any, bytes | None]]) -> Upload:
        with ExitStack() as stack:
            sink = _Ingest(stack, storage, key, max_bytes, file_field)
            parser = _parser(boundary, sink.callbacks())
            while (chunk := anyio.from_thread.run(receive)) is not None:
                if chunk:
                    try:
                        parser.write(chunk)
                    except FormParserError as error:
                        if "header size" in str(error):
                            raise _header_too_long() from error
                        raise invalid_request(f"Malformed multipart body: {error}") from error
            if not sink.ended:
                raise invalid_request("The multipart body ended before its closing boundary.")
            if sink.result.filename is None:
                raise invalid_request(
                    f"Missing required parameter: '{file_field}'.", param=file_field
                )
            finish(sink.result)
            return sink.result

    slots = _slots(settings.max_concurrent_uploads)
    try:
        return await anyio.to_thread.run_sync(ingest, next_chunk, limiter=slots)
    except ClientDisconnect as error:
        raise invalid_request("The client disconnected during the upload.") from error


async def _drain(stream: AsyncIterator[bytes], timeout_s: float) -> None:
    """Read (and drop) up to DRAIN_LIMIT more bytes for at most ``timeout_s``."""
    drained = 0
    with anyio.move_on_after(timeout_s):
        try:
            async for chunk in stream:
                drained += len(chunk)
                if drained > DRAIN_LIMIT:
                    return
        except (ClientDisconnect, RuntimeError):
            return
