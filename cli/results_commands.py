"""``batchd results`` and ``batchd retry``: batchd's extensions beside the OpenAI shapes.

``results`` writes the lines committed so far, or follows them until the batch ends
(``GET /v1/batches/{id}/results``); ``retry`` creates a batch of the lines that did not
succeed (``POST /v1/batches/{id}/retry``); ``download --with-retries`` merges them
(:mod:`cli.downloads`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from cli.client import BatchdClient
from cli.console import api_client, exit_with, stderr
from cli.exit_codes import exit_codes_help
from cli.options import ApiKeyOpt, BaseUrlOpt, BatchIdArg, JsonOpt, PollOpt, TimeoutOpt
from cli.waiting import announce_and_wait, finish_wait, wait_for_batch
from core.batches.retry import RETRY_KINDS
from core.database.results_log import MAX_PAGE

# ------------------------------------------------------------------------------ results


def last_line_id(path: Path) -> str | None:
    """The ``id`` of the last whole line of ``path`` (where a follow resumes), or None."""
    if not path.exists():
        return None
    last = None
    with path.open("rb") as fh:
        for raw in fh:
            if raw.endswith(b"\n") and raw.strip():
                last = raw
    return json.loads(last).get("id") if last else None


def _drain(
    client: BatchdClient, batch_id: str, after: str | None, out: IO[bytes]
) -> tuple[str | None, int]:
    """Write every line logged after ``after``; the new cursor and the count written."""
    written = 0
    while True:
        page = client.batch_results(batch_id, after=after, limit=MAX_PAGE)
        for line in page.get("data") or []:
            out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
            written += 1
        out.flush()
        after = page.get("last_id") or after
        if not page.get("has_more"):
            return after, written


def results(
    batch_id: BatchIdArg,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Append the lines here (a rerun resumes after the file's last line); "
            "default: standard output.",
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", help="Keep appending lines as they commit until the batch ends."),
    ] = False,
    poll_interval: PollOpt = 2.0,
    timeout: TimeoutOpt = None,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Write a batch's result lines committed so far, in commit order, each exactly as in the
    final output or error file. With --follow, exit when the batch ends (exit codes as
    `wait`)."""
    after = last_line_id(output) if output is not None else None
    with api_client(base_url, api_key) as client, _Sink(output) as out:
        batch = client.get_batch(batch_id)  # a missing batch fails before anything is written
        after, total = _drain(client, batch_id, after, out)
        if not follow:
            stderr().print(f"{total} lines ({batch.get('status')})")
            return

        def drain(_: dict[str, Any]) -> None:
            nonlocal after, total
            after, n = _drain(client, batch_id, after, out)
            total += n

        batch, timed_out = wait_for_batch(
            client,
            batch_id,
            poll_interval=poll_interval,
            timeout=timeout,
            show_progress=False,
            batch=batch,
            on_poll=drain,
        )
        if timed_out:
            raise exit_with(finish_wait(batch, True, as_json=False))
        # The batch's end commits its last lines with it: one more pass takes them all.
        drain(batch)
    stderr().print(f"{total} lines written")
    raise exit_with(finish_wait(batch, False, as_json=False))


class _Sink:
    """Append to ``path``, or write to standard output."""

    def __init__(self, path: Path | None):
        self.path = path
        self._fh: IO[bytes] | None = None

    def __enter__(self) -> IO[bytes]:
        if self.path is None:
            return sys.stdout.buffer
        self._fh = self.path.open("ab")
        return self._fh

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()


# ------------------------------------------------------------------------------ retry


def retry(
    batch_id: BatchIdArg,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="expired, cancelled, budget_exhausted or failed (retryable errors only); "
            "repeat for more. Default: all four.",
        ),
    ] = None,
    window: Annotated[
        str | None, typer.Option(help="Completion window (default: the parent's).")
    ] = None,
    priority: Annotated[
        str | None, typer.Option(help="high | normal | low (default: the parent's).")
    ] = None,
    max_total_tokens: Annotated[
        int | None, typer.Option(min=1, help="The retry's own token budget (default: none).")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the retry to finish.")] = False,
    poll_interval: PollOpt = 2.0,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Create a batch of the lines of BATCH_ID that did not succeed; print its id."""
    for kind in include or []:
        if kind not in RETRY_KINDS:
            raise typer.BadParameter(
                f"{kind!r} is not one of {', '.join(RETRY_KINDS)}", param_hint="--include"
            )
    with api_client(base_url, api_key) as client:
        batch = client.retry_batch(
            batch_id,
            include=include or None,
            completion_window=window,
            priority=priority,
            max_total_tokens=max_total_tokens,
        )
        waited = announce_and_wait(
            client, batch, wait=wait, as_json=as_json,
            note=f"retrying {batch_id} as {batch['id']}",
            poll_interval=poll_interval, timeout=timeout,
        )  # fmt: skip
    if waited is None:
        return
    raise exit_with(finish_wait(*waited, as_json=as_json))


def register(app: typer.Typer) -> None:
    epilog = exit_codes_help()
    app.command(name="results", epilog=epilog)(results)
    app.command(name="retry", epilog=epilog)(retry)
