"""Checks a batch create and an estimate share: the completion window (the server's range and
the API key's entitlement) and the input file."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request
from api.routes.files import get_file_row
from core.models import File
from core.settings import Settings
from core.windows import duration, window_seconds


def checked_window_s(window: str, caller: Caller, settings: Settings) -> int:
    """The completion window in seconds: 400 outside the server's range, 403 below the API
    key's shortest window (an early deadline is an entitlement, like priority)."""
    seconds = window_seconds(window) or 0
    if seconds > settings.max_completion_window_s:
        raise invalid_request(
            f"Invalid value for 'completion_window': {window} is longer than the maximum of "
            f"{settings.max_completion_window_s} seconds "
            f"({duration(settings.max_completion_window_s)}).",
            param="completion_window",
        )
    if seconds < settings.min_completion_window_s:
        raise invalid_request(
            f"Invalid value for 'completion_window': {window} is shorter than the minimum of "
            f"{settings.min_completion_window_s} seconds "
            f"({duration(settings.min_completion_window_s)}).",
            param="completion_window",
        )
    shortest = caller.min_completion_window_s
    if shortest is not None and seconds < shortest and not caller.admin:
        raise APIError(
            403,
            f"This API key may create batches with a completion window of at least "
            f"{duration(shortest)} ({shortest} seconds); '{window}' is shorter. An "
            "administrator can create a key that may use it "
            f"(`batchd keys create --min-completion-window {window}`).",
            param="completion_window",
            code="completion_window_not_allowed",
            headers={"x-should-retry": "false"},
        )
    return seconds


def batch_input_file(session: Session, tenant: str, file_id: str) -> File:
    """The tenant's file ``file_id``, uploaded for batches (404 or 400 otherwise)."""
    input_file = get_file_row(session, tenant, file_id, param="input_file_id")
    if input_file.purpose != "batch":
        raise invalid_request(
            f"The input file {input_file.id} has purpose '{input_file.purpose}'; "
            "a batch needs a file uploaded with purpose 'batch'.",
            param="input_file_id",
        )
    return input_file
