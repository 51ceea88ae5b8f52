"""Identifiers in OpenAI's shapes: a kind's prefix and random hex (``file-…``, ``batch_…``,
``upload_…``, ``part_…``, ``msgbatch_…``, ``batch_req_…`` for what the service stores;
``chatcmpl-…``, ``cmpl-…``, ``resp_…``, ``msg_…``, ``req_…`` inside result lines).

Stored ids take their hex from ``secrets``; result-line ids from a per-process generator seeded
from ``secrets`` (again in a forked child): as unique, without an ``os.urandom`` call (which
releases and retakes the GIL) per id (docs/scaling.md)."""

from __future__ import annotations

import os
import random
import secrets

_lines = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _lines.seed(secrets.randbits(128)))


def _token(nbytes: int = 12) -> str:
    return secrets.token_hex(nbytes)


def _line_token(nbytes: int = 12) -> str:
    return f"{_lines.getrandbits(8 * nbytes):0{2 * nbytes}x}"


def file_id() -> str:
    return f"file-{_token()}"


def batch_id() -> str:
    return f"batch_{_token()}"


def message_batch_id() -> str:
    return f"msgbatch_{_token()}"


def upload_id() -> str:
    return f"upload_{_token()}"


def upload_part_id() -> str:
    return f"part_{_token()}"


def batch_request_id() -> str:
    return f"batch_req_{_line_token()}"


def chat_completion_id() -> str:
    return f"chatcmpl-{_line_token()}"


def completion_id() -> str:
    return f"cmpl-{_line_token()}"


def response_id() -> str:
    return f"resp_{_line_token(24)}"


def message_id() -> str:
    return f"msg_{_line_token(24)}"


def request_id() -> str:
    return f"req_{_line_token(16)}"
