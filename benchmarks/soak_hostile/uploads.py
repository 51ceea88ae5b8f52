"""The Uploads API past its bounds: the answer each step must get."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

UPLOAD_EXPECT = {
    "create": 200,
    "part within bytes": 200,
    "part past bytes": 400,
    "part past the parts bound": 400,
    "complete": 200,
    "part after complete": 400,
    "cancel after complete": 400,
    "cancel": 200,
    "part after cancel": 400,
    "complete after cancel": 400,
}


@dataclass(frozen=True, slots=True)
class UploadAnswer:
    began: float
    t: float
    kind: str  # a key of UPLOAD_EXPECT
    status: int | None  # None: no answer (connection refused or reset, timeout)
    code: str | None = None  # the error's code, for a 4xx


def _error_code(r: httpx.Response | None) -> str | None:
    if r is None or r.status_code < 400:
        return None
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return None if code is None else str(code)
