"""The validation scan of ``batchd run``'s input: every line once, in bounded memory."""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.batchfile.reader import RawLine, iter_lines, parse_request
from core.batchfile.request import BatchRequest, LineError
from core.llms.generation import (
    error_record,
)

if TYPE_CHECKING:
    pass
from cli.run.options import RunOptions


def _custom_id_hash(custom_id: str) -> int:
    digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _custom_id_of(raw: RawLine) -> str | None:
    """The line's custom_id when it has a usable one, for error lines of invalid requests."""
    try:
        obj = json.loads(raw.data)
    except ValueError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def line_error_record(raw: RawLine, err: LineError) -> dict[str, Any]:
    """An input line that does not validate: an error line naming the line number."""
    message = err.message if err.message.startswith("Line ") else f"Line {raw.line}: {err.message}"
    return error_record(_custom_id_of(raw), err.code, message, param=err.param)


@dataclass(slots=True)
class ScanReport:
    """What the validation scan found; ``duplicates`` maps each custom_id used more than once
    to the line of its first use (usually empty)."""

    num_lines: int = 0
    num_requests: int = 0
    num_invalid: int = 0
    first_errors: list[LineError] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)

    @property
    def num_valid(self) -> int:
        return self.num_requests - self.num_invalid


def parse_line(raw: RawLine, options: RunOptions) -> BatchRequest:
    return parse_request(
        raw,
        endpoint=options.endpoint,
        served_models=options.served_models,
        max_line_bytes=options.max_line_bytes,
    )


def scan_input(options: RunOptions, keep_errors: int = 10) -> ScanReport:
    """Validate every line once, in bounded memory (16 bytes per valid request).

    Duplicate custom_ids are found by sorting 64-bit hashes; the few lines whose hash repeats
    are then read again to compare the ids themselves, so a hash collision is never reported.
    """
    import numpy as np

    report = ScanReport()
    hashes = array("q")
    with open(options.input, "rb") as fh:
        for raw in iter_lines(fh, max_line_bytes=options.max_line_bytes):
            report.num_lines = raw.line
            report.num_requests += 1
            try:
                req = parse_line(raw, options)
            except LineError as err:
                report.num_invalid += 1
                if len(report.first_errors) < keep_errors:
                    report.first_errors.append(err)
                continue
            hashes.append(_custom_id_hash(req.custom_id))
    if len(hashes) < 2:
        return report
    h = np.frombuffer(hashes, dtype=np.int64)
    order = np.argsort(h, kind="stable")
    sorted_h = h[order]
    repeated = sorted_h[1:] == sorted_h[:-1]
    if not repeated.any():
        return report
    suspect_hashes = set(sorted_h[1:][repeated].tolist())
    del h, order, sorted_h, repeated, hashes
    first_line: dict[str, int] = {}
    with open(options.input, "rb") as fh:
        for raw in iter_lines(fh, max_line_bytes=options.max_line_bytes):
            try:
                req = parse_line(raw, options)
            except LineError:
                continue
            if _custom_id_hash(req.custom_id) not in suspect_hashes:
                continue
            first = first_line.setdefault(req.custom_id, raw.line)
            if first != raw.line:
                report.duplicates[req.custom_id] = first
                report.num_invalid += 1
                if len(report.first_errors) < keep_errors:
                    report.first_errors.append(duplicate_error(raw.line, req.custom_id, first))
    return report


def duplicate_error(line: int, custom_id: str, first: int) -> LineError:
    return LineError(
        line,
        "duplicate_custom_id",
        f"custom_id {json.dumps(custom_id)[:60]} on line {line} was already used on line "
        f"{first}; custom_id must be unique within a batch",
        "custom_id",
    )
