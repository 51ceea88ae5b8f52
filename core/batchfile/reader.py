"""The OpenAI batch input format: the streaming line reader (:func:`iter_lines`), one line's
check (:func:`parse_request`) and whole-file validation (:class:`LineValidator`,
:func:`validate_file`). ``docs/batch-files.md`` has the line rules and the error codes.

Invariants: line numbers (1-based, blank lines counted) and byte offsets are absolute in the
upload, so a shard re-reading its byte range sees what validation saw; memory is bounded (an
over-long line is never held whole, whole-file validation holds only the ``custom_id`` set);
blank lines are never requests or errors; ``LineError`` codes and params are API: stable."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from core.batchfile.bodies import KINDS, check_body
from core.batchfile.request import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_CUSTOM_ID_CHARS,
    SUPPORTED_URLS,
    BatchRequest,
    LineError,
    show,
    type_name,
)
from core.batchfile.results import request_error_line

__all__ = [
    "FILE_ERRORS",
    "LineValidator",
    "RawLine",
    "ValidationReport",
    "custom_id_of",
    "file_endpoint",
    "line_error_record",
    "iter_lines",
    "parse_request",
    "validate_file",
]

_CHUNK_SIZE = 1 << 16
_BOM = b"\xef\xbb\xbf"
_BLANK = b" \t\r\n\x0b\x0c"


# --------------------------------------------------------------------------------------------
# Line reading


@dataclass(frozen=True, slots=True)
class RawLine:
    """One physical line: ``line`` is 1-based, ``offset`` the byte offset of its first byte,
    ``length`` its size in bytes including the line ending, ``data`` its bytes without the
    line ending. ``too_long`` lines carry empty ``data``."""

    line: int
    offset: int
    length: int
    data: bytes
    too_long: bool = False


def _chunks(source: BinaryIO | Iterable[bytes], chunk_size: int) -> Iterator[bytes]:
    read = getattr(source, "read", None)
    if read is not None:
        while chunk := read(chunk_size):
            yield chunk
    else:
        for chunk in source:
            if chunk:
                yield chunk


def iter_lines(
    stream: BinaryIO | Iterable[bytes],
    *,
    max_line_bytes: int,
    first_line: int = 1,
    base_offset: int = 0,
    chunk_size: int = _CHUNK_SIZE,
) -> Iterator[RawLine]:
    """Yield the non-blank lines of ``stream`` (a binary file object, or an iterable of byte
    chunks such as ``Storage.read_range``) in bounded memory (about one chunk plus
    ``max_line_bytes``).

    ``first_line``/``base_offset`` give the line number and absolute byte offset of the first
    byte of ``stream``, for re-reading a range of a larger file; the BOM check applies only
    when ``base_offset`` is 0.
    """
    if max_line_bytes < 1:
        raise ValueError("max_line_bytes must be >= 1")
    chunks = _chunks(stream, chunk_size)
    buf = bytearray()
    pos = base_offset  # absolute offset of buf[0]
    line_no = first_line
    skipping = False  # discarding the rest of an over-long line
    skip_start = 0
    at_start = base_offset == 0

    if at_start:
        while len(buf) < len(_BOM):
            chunk = next(chunks, None)
            if chunk is None:
                break
            buf += chunk
        if buf.startswith(_BOM):
            del buf[: len(_BOM)]
            pos += len(_BOM)

    def finish_line(start: int, end: int, length: int) -> RawLine | None:
        """``buf[start:end]`` is the line without its newline; None for blank lines."""
        content_end = end
        if content_end > start and buf[content_end - 1] == 0x0D:
            content_end -= 1
        if content_end - start > max_line_bytes:
            return RawLine(line_no, pos + start, length, b"", True)
        data = bytes(buf[start:content_end])
        if not data.strip(_BLANK):
            return None
        return RawLine(line_no, pos + start, length, data)

    scan = 0
    while True:
        start = 0
        while (nl := buf.find(b"\n", max(start, scan))) >= 0:
            if skipping:
                yield RawLine(line_no, skip_start, pos + nl + 1 - skip_start, b"", True)
                skipping = False
            else:
                raw = finish_line(start, nl, nl + 1 - start)
                if raw is not None:
                    yield raw
            line_no += 1
            start = nl + 1
        if start:
            del buf[:start]
            pos += start
        # buf now holds the start of an unterminated line (or nothing).
        if skipping:
            pos += len(buf)
            buf.clear()
        elif len(buf) > max_line_bytes + 1:  # +1: a trailing "\r" is not data
            skipping = True
            skip_start = pos
            pos += len(buf)
            buf.clear()
        scan = len(buf)
        chunk = next(chunks, None)
        if chunk is None:
            break
        buf += chunk

    if skipping:
        yield RawLine(line_no, skip_start, pos - skip_start, b"", True)
    elif buf:
        raw = finish_line(0, len(buf), len(buf))
        if raw is not None:
            yield raw


# --------------------------------------------------------------------------------------------
# One line


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# A \\u escape of a UTF-16 surrogate: JSON allows a lone one, Unicode (and UTF-8) does not.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) of ``obj`` holding a lone surrogate, if any; iterative,
    so however deep ``obj`` is."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
    return None


def _required(
    line: int,
    value: Any,
    param: str,
    expected: type[str] | type[dict],
    *,
    missing: str = "missing_required_param",
    invalid: str = "invalid_type",
) -> Any:
    """``value`` (the line's ``param``) when it is present and of the ``expected`` type;
    otherwise the :class:`LineError` with the ``missing`` or the ``invalid`` code."""
    if value is None:
        raise LineError(line, missing, f"{param} is required", param)
    if not isinstance(value, expected):
        a = "a string" if expected is str else "an object"
        raise LineError(line, invalid, f"{param} must be {a}, got {type_name(value)}", param)
    return value


def _load_object(raw: RawLine, max_line_bytes: int | None) -> dict[str, Any]:
    line = raw.line
    if raw.too_long:
        limit = f"the limit of {max_line_bytes} bytes" if max_line_bytes else "the limit"
        raise LineError(
            line, "line_too_long", f"Line {line} is {raw.length} bytes, over {limit} for one line"
        )
    try:
        text = raw.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(
            line,
            "invalid_encoding",
            f"Line {line} is not valid UTF-8 (byte {exc.start} of the line)",
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise LineError(
            line, "invalid_json_line", f"Line {line} is nested too deeply to be parsed"
        ) from None
    except ValueError as exc:
        raise LineError(
            line, "invalid_json_line", f"Line {line} is not valid JSON: {exc}"
        ) from None
    if not isinstance(obj, dict):
        raise LineError(
            line, "invalid_json_line", f"Line {line} must be a JSON object, got {type_name(obj)}"
        )
    # Every later step (tokenizer, error messages, the API's JSON) needs valid Unicode.
    if _SURROGATE_ESCAPE.search(text) and _lone_surrogate(obj) is not None:
        raise LineError(
            line,
            "invalid_encoding",
            f"Line {line} holds a \\u escape of a lone UTF-16 surrogate, which is not valid "
            "Unicode (a surrogate escape must be a high one followed by a low one)",
        )
    return obj


def file_endpoint(
    stream: BinaryIO | Iterable[bytes], *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> tuple[str, int] | None:
    """The ``url`` every line of a batch file targets, with the line that first named it; None
    when no line names one. A line naming another ``url`` raises ``LineError``
    (``mixed_endpoints``): a batch targets one endpoint. Lines that do not parse, or carry no
    string ``url``, are left to validation."""
    first: tuple[str, int] | None = None
    for raw in iter_lines(stream, max_line_bytes=max_line_bytes):
        try:
            url = _load_object(raw, max_line_bytes).get("url")
        except LineError:
            continue
        if not isinstance(url, str):
            continue
        if first is None:
            first = (url, raw.line)
        elif url != first[0]:
            raise LineError(
                raw.line,
                "mixed_endpoints",
                f"Line {raw.line} has url {show(url)} but line {first[1]} has "
                f"{show(first[0])}: a batch targets one endpoint (split the file by url)",
                "url",
            )
    return first


#: The models whose lines go to an upstream as written: a mapping to the reserved fields each
#: upstream's operator allows (:func:`core.llms.specs.forwarded_models`), or just their names.
Forwarded = Mapping[str, Collection[str]] | Collection[str]


def parse_request(
    raw: RawLine,
    *,
    endpoint: str,
    served_models: Collection[str] | None,
    max_line_bytes: int | None = None,
    forwarded: Forwarded = (),
) -> BatchRequest:
    """Validate and normalise one line; raise :class:`LineError` on the first problem.

    ``endpoint`` is the batch's endpoint; ``served_models`` the model names accepted (None
    skips the check, e.g. when re-parsing in a shard task). ``max_line_bytes`` only names the
    limit in the ``line_too_long`` message. ``forwarded``: the models whose bodies go to an
    upstream server as written, each with the reserved fields its operator allows
    (:func:`core.llms.specs.forwarded_models`; a plain collection of names allows none); their
    lines may hold fields this service does not know (see
    :func:`core.batchfile.bodies.check_body`).
    """
    line = raw.line
    obj = _load_object(raw, max_line_bytes)

    custom_id = _required(
        line, obj.get("custom_id"), "custom_id", str,
        missing="missing_custom_id", invalid="invalid_custom_id",
    )  # fmt: skip
    if not custom_id:
        raise LineError(line, "invalid_custom_id", "custom_id must not be empty", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(
            line,
            "invalid_custom_id",
            f"custom_id must be at most {MAX_CUSTOM_ID_CHARS} characters, got {len(custom_id)}",
            "custom_id",
        )

    method = obj.get("method")
    if method != "POST":
        got = "nothing" if method is None else show(method)
        raise LineError(line, "invalid_method", f'method must be "POST", got {got}', "method")

    url = obj.get("url")
    if not isinstance(url, str) or url not in SUPPORTED_URLS:
        got = "nothing" if url is None else show(url)
        raise LineError(
            line, "invalid_url", f"url must be one of {', '.join(SUPPORTED_URLS)}, got {got}", "url"
        )
    if url != endpoint:
        raise LineError(
            line,
            "mismatched_url",
            f"url must match the batch's endpoint {endpoint}, got {url}",
            "url",
        )

    body = _required(line, obj.get("body"), "body", dict)
    model = _required(line, body.get("model"), "body.model", str)
    if served_models is not None and model not in served_models:
        served = ", ".join(sorted(served_models)) or "none"
        raise LineError(
            line,
            "model_not_found",
            f"The model {show(model)} is not served here for {endpoint} (served for it: {served})",
            "body.model",
        )
    if not model:
        raise LineError(line, "invalid_value", "body.model must not be empty", "body.model")

    req = BatchRequest(
        line=line,
        offset=raw.offset,
        length=raw.length,
        custom_id=custom_id,
        url=url,
        model=model,
        body=body,
        kind=KINDS[url],
    )
    allowed = forwarded.get(model, ()) if isinstance(forwarded, Mapping) else ()
    check_body(req, forwarded=model in forwarded, allowed=allowed)
    return req


# --------------------------------------------------------------------------------------------
# The whole file


@dataclass
class ValidationReport:
    """The outcome of :func:`validate_file`.

    ``num_requests`` counts valid requests; ``num_invalid`` lines that failed; ``errors`` holds
    the first ``max_errors`` errors in line order, ``num_more_errors`` how many were left out.
    ``model`` is the batch's model (the first valid request's; an adapter's base). ``truncated`` is True when
    validation stopped early at the request limit.
    """

    num_requests: int = 0
    num_invalid: int = 0
    num_lines: int = 0  # number of the last non-blank line read
    model: str | None = None
    errors: list[LineError] = field(default_factory=list)
    num_more_errors: int = 0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors and not self.num_more_errors

    @property
    def num_errors(self) -> int:
        return len(self.errors) + self.num_more_errors

    def error_dicts(self) -> list[dict[str, Any]]:
        """``errors.data`` for the batch object."""
        return [e.to_dict() for e in self.errors]

    def add_error(self, err: LineError, max_errors: int) -> None:
        """Keep ``err`` if fewer than ``max_errors`` are kept, else count it."""
        if len(self.errors) < max_errors:
            self.errors.append(err)
        else:
            self.num_more_errors += 1


class LineValidator:
    """The lines of one file checked in order, one at a time, with the file-wide rules: unique
    ``custom_id``, one model per batch (the first valid request's; ``engine_models`` maps each
    LoRA adapter to its base, whose engine runs it: the lines of a base and of its adapters
    make one batch, whose model is the base), at most ``max_requests`` request lines. :func:`validate_file` runs a whole file through it; the validate task runs
    it line by line and plans shards as it goes (see "Validation streamed into execution" in
    ``docs/batch-files.md``).

    Memory is bounded by the ``custom_id`` set (at most ``max_requests`` entries).
    """

    def __init__(
        self,
        *,
        endpoint: str,
        served_models: Collection[str] | None,
        max_requests: int,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        forwarded: Forwarded = (),
        engine_models: Mapping[str, str] | None = None,
    ):
        self.endpoint = endpoint
        self.served_models = served_models
        self.max_requests = max_requests
        self.max_line_bytes = max_line_bytes
        self.forwarded = forwarded
        self.engine_models: Mapping[str, str] = engine_models or {}
        self.model: str | None = None
        self.model_line = 0
        self.first_model: str | None = None  # as the first request wrote it
        self.request_lines = 0  # non-blank lines checked so far, valid or not
        self._seen: dict[str, int] = {}

    def check(self, raw: RawLine) -> BatchRequest:
        """The request on ``raw``, or :class:`LineError`. A ``too_many_requests`` error
        (:data:`FILE_ERRORS`) is about the whole file: no later line can be valid."""
        self.request_lines += 1
        if self.request_lines > self.max_requests:
            raise LineError(
                raw.line,
                "too_many_requests",
                f"The file holds more than {self.max_requests} requests, the limit for one "
                f"batch (line {raw.line} is request {self.request_lines})",
            )
        req = parse_request(
            raw,
            endpoint=self.endpoint,
            served_models=self.served_models,
            max_line_bytes=self.max_line_bytes,
            forwarded=self.forwarded,
        )
        first = self._seen.get(req.custom_id)
        if first is not None:
            raise LineError(
                raw.line,
                "duplicate_custom_id",
                f"custom_id {show(req.custom_id)} on line {raw.line} was already used on "
                f"line {first}; custom_id must be unique within a batch",
                "custom_id",
            )
        self._seen[req.custom_id] = raw.line
        engine = self.engine_models.get(req.model, req.model)
        if self.model is None:
            self.model = engine
            self.model_line = raw.line
            self.first_model = req.model
        elif engine != self.model:
            adapters = (
                " (an adapter's lines may share a batch only with its base model's and its "
                "other adapters')"
                if self.engine_models
                else ""
            )
            raise LineError(
                raw.line,
                "mismatched_model",
                f"All requests in a batch must use the same model: line {raw.line} uses "
                f"{show(req.model)}, line {self.model_line} uses {show(self.first_model)}"
                + adapters,
                "body.model",
            )
        return req


# Errors about the whole file rather than one line: after the head they still fail the batch.
FILE_ERRORS = frozenset({"empty_file", "too_many_requests"})


def custom_id_of(raw: RawLine) -> str | None:
    """The ``custom_id`` a line names, if it can be read at all (for the error line of a line
    that failed validation)."""
    return custom_id_in(raw.data)


def custom_id_in(data: bytes) -> str | None:
    """The string ``custom_id`` of a line's bytes; None for anything validation would refuse
    to read (not JSON, not an object, nested too deeply, a ``custom_id`` that is no string).
    Every reader of a line that may never have been validated goes through here."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def line_error_record(raw: RawLine, err: LineError) -> dict[str, Any]:
    """The error-file line of an input line that failed validation after the file's head:
    the 400 response the endpoint would have answered (OpenAI's error-file shape), under the
    line's ``custom_id`` when it names one, its ``error`` carrying the ``line`` number and a
    message that names it."""
    message = err.message
    if f"line {raw.line}" not in message.lower():
        message = f"Line {raw.line}: {message}"
    record = request_error_line(
        custom_id_of(raw), status_code=400, message=message, code=err.code, param=err.param
    )
    record["response"]["body"]["error"]["line"] = raw.line
    return record


def validate_file(
    stream: BinaryIO | Iterable[bytes],
    *,
    endpoint: str,
    served_models: Collection[str] | None,
    max_requests: int,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_errors: int = 100,
    on_request: Callable[[BatchRequest], None] | None = None,
    forwarded: Forwarded = (),
    engine_models: Mapping[str, str] | None = None,
) -> ValidationReport:
    """Stream every line of ``stream`` through a :class:`LineValidator` (:func:`parse_request`
    and the file-wide checks: unique ``custom_id``, one model per batch, at most
    ``max_requests`` request lines, not empty); ``forwarded`` as for :func:`parse_request`,
    ``engine_models`` as for :class:`LineValidator`.

    ``on_request`` is called, in line order, for each valid request that passed every check;
    exceptions it raises propagate. Memory is bounded by the ``custom_id`` set (at most
    ``max_requests`` entries) plus one line.
    """
    report = ValidationReport()
    lines = LineValidator(
        endpoint=endpoint,
        served_models=served_models,
        max_requests=max_requests,
        max_line_bytes=max_line_bytes,
        forwarded=forwarded,
        engine_models=engine_models,
    )
    for raw in iter_lines(stream, max_line_bytes=max_line_bytes):
        report.num_lines = raw.line
        try:
            req = lines.check(raw)
        except LineError as err:
            report.add_error(err, max_errors)
            if err.code == "too_many_requests":
                report.truncated = True
                break
            report.num_invalid += 1
            continue
        report.num_requests += 1
        if on_request is not None:
            on_request(req)
    report.model = lines.model
    if lines.request_lines == 0:
        report.add_error(LineError(None, "empty_file", "The file holds no requests"), max_errors)
    return report
