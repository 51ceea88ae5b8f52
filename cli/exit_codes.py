"""Exit codes of the ``batchd`` command, stable so that pipelines can branch on them."""

from __future__ import annotations

from enum import IntEnum

from core.database.lifecycle import TERMINAL, BatchStatus


class ExitCode(IntEnum):
    """What a ``batchd`` command's exit status means.

    ``status``, ``list``, ``cancel``, ``download`` and ``submit`` without ``--wait`` exit 0
    when the call succeeded. ``wait``, ``submit --wait`` and ``run`` exit with the outcome of
    the batch.
    """

    OK = 0  # completed, and no request failed
    ERROR = 1  # the server refused the call (its message is printed), or another failure
    USAGE = 2  # bad arguments or an unusable input file (the same code click uses)
    COMPLETED_WITH_FAILURES = 3  # completed, but some requests are in the error file
    FAILED = 4  # the batch failed (e.g. its input file did not validate)
    EXPIRED = 5  # the completion window passed before the batch finished
    CANCELLED = 6  # the batch was cancelled
    TIMEOUT = 7  # --timeout passed while waiting; the batch goes on
    UNREACHABLE = 8  # no connection to the server (wrong URL, server down, TLS, …)
    INTERRUPTED = 130  # Ctrl-C / SIGINT (``batchd run`` resumes where it stopped)


#: The terminal statuses of a batch (each one maps to an exit code).
TERMINAL_STATUSES = TERMINAL


def exit_code_for_batch(batch: dict) -> ExitCode:
    """The exit code for a batch object in a terminal status."""
    status = batch.get("status")
    if status == BatchStatus.COMPLETED:
        counts = batch.get("request_counts") or {}
        return ExitCode.COMPLETED_WITH_FAILURES if counts.get("failed") else ExitCode.OK
    codes: dict[str | None, ExitCode] = {
        BatchStatus.FAILED: ExitCode.FAILED,
        BatchStatus.EXPIRED: ExitCode.EXPIRED,
        BatchStatus.CANCELLED: ExitCode.CANCELLED,
    }
    return codes.get(status, ExitCode.ERROR)


def exit_codes_help() -> str:
    """The table shown at the end of ``--help``."""
    meanings = {
        ExitCode.OK: "completed with no failed request (or the call succeeded)",
        ExitCode.ERROR: "the server refused the call, or another error",
        ExitCode.USAGE: "usage error or unusable input file",
        ExitCode.COMPLETED_WITH_FAILURES: "completed, some requests failed (see the error file)",
        ExitCode.FAILED: "the batch failed",
        ExitCode.EXPIRED: "the batch expired",
        ExitCode.CANCELLED: "the batch was cancelled",
        ExitCode.TIMEOUT: "--timeout passed while waiting",
        ExitCode.UNREACHABLE: "the server could not be reached",
        ExitCode.INTERRUPTED: "interrupted (batchd run resumes when re-run)",
    }
    rows = "\n\n".join(f"{int(code):>3}  {text}" for code, text in meanings.items())
    return f"Exit codes:\n\n{rows}"
