"""Identifiers in OpenAI's shapes: a kind's prefix and random hex, ``file-…``, ``batch_…``,
``batch_req_…`` for what the service stores, ``chatcmpl-…``, ``cmpl-…``, ``resp_…``,
``msg_…`` and ``req_…`` inside the result lines it writes."""

from __future__ import annotations

import secrets


def _token(nbytes: int = 12) -> str:
    return secrets.token_hex(nbytes)


def file_id() -> str:
    return f"file-{_token()}"


def batch_id() -> str:
    return f"batch_{_token()}"


def batch_request_id() -> str:
    return f"batch_req_{_token()}"


def chat_completion_id() -> str:
    return f"chatcmpl-{_token()}"


def completion_id() -> str:
    return f"cmpl-{_token()}"


def response_id() -> str:
    return f"resp_{_token(24)}"


def message_id() -> str:
    return f"msg_{_token(24)}"


def request_id() -> str:
    return f"req_{_token(16)}"
