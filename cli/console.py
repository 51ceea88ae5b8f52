"""Where a client command writes, and the API client whose failures become an exit code.

Standard output carries only what a script consumes (a batch id, or JSON with ``--json``);
progress bars, tables for people and error messages go to standard error, except the tables of
``status`` and ``list``, which are the output. Exit codes are :class:`cli.exit_codes.ExitCode`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

from cli.client import BatchdClient, ClientError, ServerUnreachable
from cli.exit_codes import ExitCode


def stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def stdout() -> Console:
    return Console(highlight=False, soft_wrap=True)


def exit_with(code: ExitCode) -> typer.Exit:
    return typer.Exit(int(code))


def escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


@contextmanager
def api_client(base_url: str | None, api_key: str | None) -> Iterator[BatchdClient]:
    """A client whose failures become a one-line message and the matching exit code."""
    client = BatchdClient(base_url, api_key)
    try:
        yield client
    except ServerUnreachable as exc:
        stderr().print(f"[bold red]error:[/] {exc.message}", markup=True, highlight=False)
        raise exit_with(ExitCode.UNREACHABLE) from None
    except ClientError as exc:
        stderr().print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
        raise exit_with(ExitCode.ERROR) from None
    finally:
        client.close()


def counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """The batch's completed, failed and total requests."""
    request_counts = batch.get("request_counts") or {}
    return (
        int(request_counts.get("completed") or 0),
        int(request_counts.get("failed") or 0),
        int(request_counts.get("total") or 0),
    )


def batch_errors(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's validation errors (``errors.data``)."""
    return (batch.get("errors") or {}).get("data") or []


def error_text(error: dict[str, Any]) -> str:
    line = f"line {error.get('line')}: " if error.get("line") is not None else ""
    return f"{line}{error.get('message')} ({error.get('code')})"
