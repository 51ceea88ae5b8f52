"""Waiting for a batch to end: one poll loop, and the report and exit code of how it ended."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import typer

from cli.client import BatchdClient, ServerUnreachable
from cli.console import batch_errors, counts, error_text, escape, print_json, stderr
from cli.exit_codes import TERMINAL_STATUSES, ExitCode, exit_code_for_batch
from cli.progress import requests_progress
from core.database.lifecycle import BatchStatus

# How long polling tolerates a server that stopped answering after it answered once (an API
# restart should not fail a pipeline that waits for hours); the first call never retries.
UNREACHABLE_GRACE_S = 30.0


def wait_for_batch(
    client: BatchdClient,
    batch_id: str,
    *,
    poll_interval: float,
    timeout: float | None,
    show_progress: bool | None = None,
    sleep: Callable[[float], None] = time.sleep,
    batch: dict[str, Any] | None = None,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Poll until the batch reaches a terminal status or ``timeout`` passes.

    Returns ``(batch, timed_out)``. A live bar (completed + failed of total, requests/s, ETA)
    is drawn on standard error when ``show_progress`` (by default, when that is a terminal).
    ``batch`` is the batch already fetched (else the first call fetches it, and fails fast);
    ``on_poll`` runs after each later fetch, and a server that stops answering it is
    tolerated as one that stops answering the fetch.
    """
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    if batch is None:
        batch = client.get_batch(batch_id)
    last_answer = time.monotonic()
    progress = requests_progress(
        "[bold]{task.fields[status]:<11}",
        "failed {task.fields[failed]}",
        "{task.fields[rate]:.1f} req/s",
        console=stderr(),
        enabled=show_progress,
    )
    done0 = sum(counts(batch)[:2])
    with progress:
        task = progress.add_task(batch_id, total=None, status="", failed=0, rate=0.0)
        while True:
            completed, failed, total = counts(batch)
            elapsed = max(time.monotonic() - start, 1e-9)
            progress.update(
                task,
                completed=completed + failed,
                total=total or None,
                status=batch.get("status", "?"),
                failed=failed,
                rate=(completed + failed - done0) / elapsed,
            )
            if batch.get("status") in TERMINAL_STATUSES:
                return batch, False
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return batch, True
            sleep(
                poll_interval if deadline is None else max(0.0, min(poll_interval, deadline - now))
            )
            try:
                batch = client.get_batch(batch_id)
                if on_poll is not None:
                    on_poll(batch)
                last_answer = time.monotonic()
            except ServerUnreachable:
                if time.monotonic() - last_answer > UNREACHABLE_GRACE_S:
                    raise


def announce_and_wait(
    client: BatchdClient,
    batch: dict[str, Any],
    *,
    wait: bool,
    as_json: bool,
    note: str,
    poll_interval: float,
    timeout: float | None,
) -> tuple[dict[str, Any], bool] | None:
    """Print a batch just created: its id (the whole Batch under ``--json`` when not
    waiting). With ``wait``, say ``note`` on standard error and wait for it to end
    (:func:`wait_for_batch`'s answer); None when not waiting."""
    if not wait:
        if as_json:
            print_json(batch)
        else:
            typer.echo(batch["id"])
        return None
    if not as_json:
        typer.echo(batch["id"])
    stderr().print(f"{note}; waiting …")
    return wait_for_batch(client, batch["id"], poll_interval=poll_interval, timeout=timeout)


def finish_wait(batch: dict[str, Any], timed_out: bool, *, as_json: bool) -> ExitCode:
    """Report the outcome of a wait and choose the exit code."""
    err = stderr()
    if timed_out:
        if as_json:
            print_json(batch)
        err.print(f"timed out waiting: batch {batch['id']} is still {batch.get('status')}")
        return ExitCode.TIMEOUT
    code = exit_code_for_batch(batch)
    completed, failed, total = counts(batch)
    if as_json:
        print_json(batch)
    message = f"batch {batch['id']} {batch.get('status')}: {completed} completed, {failed} failed of {total}"
    if batch.get("status") == BatchStatus.FAILED:
        errors = batch_errors(batch)
        for e in errors[:10]:
            message += f"\n  {error_text(e)}"
        if len(errors) > 10:
            message += f"\n  … and {len(errors) - 10} more"
    err.print(escape(message), markup=False)
    return code
