"""Identifiers in OpenAI's shapes: ``file-…``, ``batch_…``, ``batch_req_…``."""

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
