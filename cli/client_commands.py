"""Client commands for pipelines: ``submit``, ``status``, ``list``, ``wait``, ``download``,
``cancel``.

Standard output carries only what a script consumes (a batch id, or JSON with ``--json``);
progress bars, tables for people and error messages go to standard error, except the tables of
``status`` and ``list``, which are the output. Exit codes are :class:`cli.exit_codes.ExitCode`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cli import estimate_commands
from cli.client import BatchdClient, ClientError, ServerUnreachable
from cli.exit_codes import TERMINAL_STATUSES, ExitCode, exit_code_for_batch, exit_codes_help
from cli.progress import requests_progress
from core.batch_request import CHAT_URL, LineError
from core.batchfile import file_endpoint
from core.lifecycle import BatchStatus

# How long polling tolerates a server that stopped answering after it answered once (an API
# restart should not fail a pipeline that waits for hours); the first call never retries.
UNREACHABLE_GRACE_S = 30.0

BaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        envvar=["BATCHD_BASE_URL", "OPENAI_BASE_URL"],
        help="API base URL (env BATCHD_BASE_URL, then OPENAI_BASE_URL; "
        "default http://127.0.0.1:8000/v1).",
        show_envvar=False,
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar=["BATCHD_API_KEY", "OPENAI_API_KEY"],
        help="Bearer key (env BATCHD_API_KEY, then OPENAI_API_KEY).",
        show_envvar=False,
    ),
]
BatchIdArg = Annotated[str, typer.Argument(help="Batch id (batch_…).")]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print JSON on standard output (for scripts).")
]
PollOpt = Annotated[
    float, typer.Option("--poll-interval", min=0.05, help="Seconds between status polls.")
]
TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", min=0.0, help="Give up waiting after this many seconds (exit 7)."),
]


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _stdout() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _exit(code: ExitCode) -> typer.Exit:
    return typer.Exit(int(code))


@contextmanager
def _client(base_url: str | None, api_key: str | None) -> Iterator[BatchdClient]:
    """A client whose failures become a one-line message and the matching exit code."""
    client = BatchdClient(base_url, api_key)
    try:
        yield client
    except ServerUnreachable as exc:
        _stderr().print(f"[bold red]error:[/] {exc.message}", markup=True, highlight=False)
        raise _exit(ExitCode.UNREACHABLE) from None
    except ClientError as exc:
        _stderr().print(f"[bold red]error:[/] {_escape(exc.message)}", markup=True)
        raise _exit(ExitCode.ERROR) from None
    finally:
        client.close()


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _parse_metadata(items: list[str] | None) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--metadata")
        metadata[key] = value
    return metadata


def _counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    counts = batch.get("request_counts") or {}
    return (
        int(counts.get("completed") or 0),
        int(counts.get("failed") or 0),
        int(counts.get("total") or 0),
    )


def _errors(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's validation errors (``errors.data``)."""
    return (batch.get("errors") or {}).get("data") or []


def _error_text(error: dict[str, Any]) -> str:
    line = f"line {error.get('line')}: " if error.get("line") is not None else ""
    return f"{line}{error.get('message')} ({error.get('code')})"


def _when(ts: Any) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%d %H:%M:%SZ")


# ---------------------------------------------------------------------------------- waiting


def wait_for_batch(
    client: BatchdClient,
    batch_id: str,
    *,
    poll_interval: float,
    timeout: float | None,
    show_progress: bool | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[dict[str, Any], bool]:
    """Poll until the batch reaches a terminal status or ``timeout`` passes.

    Returns ``(batch, timed_out)``. A live bar (completed + failed of total, requests/s, ETA)
    is drawn on standard error when ``show_progress`` (by default, when that is a terminal).
    """
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    batch = client.get_batch(batch_id)  # the first call fails fast
    last_answer = time.monotonic()
    progress = requests_progress(
        "[bold]{task.fields[status]:<11}",
        "failed {task.fields[failed]}",
        "{task.fields[rate]:.1f} req/s",
        console=_stderr(),
        enabled=show_progress,
    )
    done0 = sum(_counts(batch)[:2])
    with progress:
        task = progress.add_task(batch_id, total=None, status="", failed=0, rate=0.0)
        while True:
            completed, failed, total = _counts(batch)
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
                last_answer = time.monotonic()
            except ServerUnreachable:
                if time.monotonic() - last_answer > UNREACHABLE_GRACE_S:
                    raise


def _finish_wait(batch: dict[str, Any], timed_out: bool, *, as_json: bool) -> ExitCode:
    """Report the outcome of a wait and choose the exit code."""
    err = _stderr()
    if timed_out:
        if as_json:
            _print_json(batch)
        err.print(f"timed out waiting: batch {batch['id']} is still {batch.get('status')}")
        return ExitCode.TIMEOUT
    code = exit_code_for_batch(batch)
    completed, failed, total = _counts(batch)
    if as_json:
        _print_json(batch)
    message = f"batch {batch['id']} {batch.get('status')}: {completed} completed, {failed} failed of {total}"
    if batch.get("status") == BatchStatus.FAILED:
        errors = _errors(batch)
        for e in errors[:10]:
            message += f"\n  {_error_text(e)}"
        if len(errors) > 10:
            message += f"\n  … and {len(errors) - 10} more"
    err.print(_escape(message), markup=False)
    return code


def _download_results(
    client: BatchdClient, batch: dict[str, Any], output: Path | None, errors: Path | None
) -> dict[str, Any]:
    """Download the output (and error) file of a finished batch; a batch with no output (or
    errors) gets an empty file, so a pipeline always finds the paths it asked for."""
    written: dict[str, Any] = {
        "output": str(output) if output else None,
        "errors": str(errors) if errors else None,
    }
    for key, path in (("output", output), ("errors", errors)):
        if path is None:
            continue
        file_id = batch.get(f"{key}_file_id" if key == "output" else "error_file_id")
        if file_id:
            written[f"{key}_bytes"] = client.download_file(file_id, path)
        else:
            Path(path).write_bytes(b"")
            written[f"{key}_bytes"] = 0
    return written


# ---------------------------------------------------------------------------------- commands


def submit(
    file: Annotated[
        Path,
        typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL batch file."),
    ],
    endpoint: Annotated[
        str | None,
        typer.Option(help="Endpoint every request targets (default: the file's first url)."),
    ] = None,
    window: Annotated[str, typer.Option(help="Completion window, e.g. 24h.")] = "24h",
    metadata: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE metadata; repeat for more.")
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Sent as the Idempotency-Key header when creating the batch."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the batch to finish.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Create nothing: print the estimate (valid lines and errors, exact prompt "
            "tokens, when it would start and end) and exit (4 if the file has errors).",
        ),
    ] = False,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="With --wait: write the output here.")
    ] = None,
    errors: Annotated[
        Path | None, typer.Option("--errors", help="With --wait: write the error file here.")
    ] = None,
    poll_interval: PollOpt = 2.0,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Upload FILE and create a batch; print its id (or the batch as JSON)."""
    meta = _parse_metadata(metadata)
    if (output or errors) and not wait:
        raise typer.BadParameter("-o/--errors need --wait (or use `batchd download`)")
    endpoint = _endpoint_for(file, endpoint)
    if dry_run:
        with _client(base_url, api_key) as client:
            code = estimate_commands.dry_run(
                client, file, endpoint=endpoint, window=window, as_json=as_json
            )
        raise _exit(code)
    with _client(base_url, api_key) as client:
        uploaded = client.upload_file(file)
        batch = client.create_batch(
            uploaded["id"],
            endpoint=endpoint,
            completion_window=window,
            metadata=meta,
            idempotency_key=idempotency_key,
        )
        if not wait:
            if as_json:
                _print_json(batch)
            else:
                typer.echo(batch["id"])
            return
        if not as_json:
            typer.echo(batch["id"])
        _stderr().print(f"submitted {batch['id']} (input {uploaded['id']}); waiting …")
        batch, timed_out = wait_for_batch(
            client, batch["id"], poll_interval=poll_interval, timeout=timeout
        )
        code = _finish_wait(batch, timed_out, as_json=as_json)
        wanted = output is not None or errors is not None
        if wanted and not timed_out and _has_results(batch):
            _download_results(client, batch, output, errors)
            wrote = " and ".join(str(p) for p in (output, errors) if p is not None)
            _stderr().print(f"wrote {wrote}")
    raise _exit(code)


def _endpoint_for(file: Path, endpoint: str | None) -> str:
    """Check that FILE targets one endpoint before anything is uploaded; without --endpoint,
    take it from the file (saying so), falling back to chat completions."""
    try:
        with file.open("rb") as fh:
            found = file_endpoint(fh)
    except LineError as exc:
        raise typer.BadParameter(f"{file}: {exc.message}", param_hint="FILE") from None
    if endpoint is None:
        if found is None:
            return CHAT_URL
        _stderr().print(f"endpoint {found[0]} (from line {found[1]}'s url; --endpoint to set it)")
        return found[0]
    if found is not None and found[0] != endpoint:
        raise typer.BadParameter(
            f"{file}: line {found[1]} has url {found[0]!r}, but --endpoint is {endpoint!r}",
            param_hint="--endpoint",
        )
    return endpoint


def _has_results(batch: dict[str, Any]) -> bool:
    """A batch that failed validation ran nothing: it has no output or error file to write
    (its errors are in the batch object), so nothing is written and the user is told so."""
    if batch.get("status") == BatchStatus.FAILED:
        _stderr().print(
            f"batch {batch['id']} failed validation: there is no output (nothing written)"
        )
        return False
    return True


def status(
    batch_id: BatchIdArg,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Show one batch."""
    with _client(base_url, api_key) as client:
        batch = client.get_batch(batch_id)
    if as_json:
        _print_json(batch)
        return
    completed, failed, total = _counts(batch)
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("id", batch.get("id")),
        ("status", batch.get("status")),
        ("endpoint", batch.get("endpoint")),
        ("requests", f"{completed} completed, {failed} failed, {total} total"),
        ("input file", batch.get("input_file_id")),
        ("output file", batch.get("output_file_id") or "-"),
        ("error file", batch.get("error_file_id") or "-"),
        ("created", _when(batch.get("created_at"))),
        ("completed", _when(batch.get("completed_at"))),
        ("expires", _when(batch.get("expires_at"))),
    ]
    if batch.get("status") in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        eta = estimate_commands.eta_text(batch.get("estimated_completion_at"), batch.get("at_risk"))
        rows.append(("estimated completion", eta))
    if batch.get("metadata"):
        rows.append(("metadata", json.dumps(batch["metadata"])))
    for key, value in rows:
        table.add_row(key, _escape(str(value)))
    _stdout().print(table)
    for e in _errors(batch)[:10]:
        _stdout().print(_escape(f"  {_error_text(e)}"))


def list_(
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many batches.")] = 20,
    after: Annotated[str | None, typer.Option(help="Page after this batch id.")] = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List recent batches, newest first."""
    with _client(base_url, api_key) as client:
        page = client.list_batches(limit=limit, after=after)
    if as_json:
        _print_json(page)
        return
    console = _stdout()
    console.print(_batch_table(page.get("data", []), console.width))
    if page.get("has_more"):
        _stderr().print(f"more: --after {page.get('last_id')}")


# The columns of `batchd list`, and the order in which a narrow terminal drops them: ids and
# statuses are never cut (a truncated id cannot be pasted into the next command).
_LIST_COLUMNS = ("id", "status", "completed", "failed", "total", "endpoint", "created")
_LIST_DROP_ORDER = ("endpoint", "created", "failed", "total", "completed")


def _batch_table(batches: list[dict[str, Any]], width: int) -> Table:
    """The table of ``batchd list``, with as many columns as fit in ``width`` whole."""
    rows = []
    for batch in batches:
        completed, failed, total = _counts(batch)
        rows.append(
            {
                "id": str(batch.get("id")),
                "status": str(batch.get("status")),
                "completed": str(completed),
                "failed": str(failed),
                "total": str(total),
                "endpoint": str(batch.get("endpoint") or "-").removeprefix("/v1/"),
                "created": _when(batch.get("created_at")),
            }
        )
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in _LIST_COLUMNS}
    columns = list(_LIST_COLUMNS)
    # Rich's default box: one rule left of each column and one at the end, one space of
    # padding on either side of each cell.
    drop = iter(_LIST_DROP_ORDER)
    while sum(widths[c] + 3 for c in columns) + 1 > width and (name := next(drop, None)):
        columns.remove(name)
    table = Table()
    for name in columns:
        table.add_column(name, no_wrap=True, min_width=widths[name] if name == "id" else None)
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    return table


def wait(
    batch_id: BatchIdArg,
    poll_interval: PollOpt = 2.0,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Wait until the batch finishes; the exit code tells how it ended."""
    with _client(base_url, api_key) as client:
        batch, timed_out = wait_for_batch(
            client, batch_id, poll_interval=poll_interval, timeout=timeout
        )
    raise _exit(_finish_wait(batch, timed_out, as_json=as_json))


def download(
    batch_id: BatchIdArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Write the output file here.")],
    errors: Annotated[
        Path | None, typer.Option("--errors", help="Write the error file here.")
    ] = None,
    with_retries: Annotated[
        bool,
        typer.Option(
            "--with-retries",
            help="Write one line per custom_id, in input order, each from the latest retry "
            "(`batchd retry`) that has it: successes and errors together in -o.",
        ),
    ] = False,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Download a finished batch's output (and error) file."""
    with _client(base_url, api_key) as client:
        batch = client.get_batch(batch_id)
        if batch.get("status") not in TERMINAL_STATUSES:
            _stderr().print(
                f"[bold red]error:[/] batch {batch_id} is {batch.get('status')}; it has no "
                f"results yet (wait for it: batchd wait {batch_id})"
            )
            raise _exit(ExitCode.ERROR)
        if not _has_results(batch):
            raise _exit(ExitCode.FAILED)
        if with_retries:
            from cli.results_commands import download_with_retries

            merged = download_with_retries(client, batch, output)
            if as_json:
                _print_json(merged)
            else:
                _stderr().print(
                    f"wrote {output} ({merged['lines']} lines, retries: "
                    f"{', '.join(merged['retries']) or 'none'})"
                )
            return
        written = _download_results(client, batch, output, errors)
    if as_json:
        _print_json(written)
    else:
        _stderr().print(
            f"wrote {output} ({written['output_bytes']} bytes)"
            + (f" and {errors} ({written['errors_bytes']} bytes)" if errors else "")
        )


def cancel(
    batch_id: BatchIdArg,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Cancel a batch (it moves to cancelling, then cancelled; finished results are kept)."""
    with _client(base_url, api_key) as client:
        batch = client.cancel_batch(batch_id)
    if as_json:
        _print_json(batch)
    else:
        typer.echo(f"{batch.get('id')} {batch.get('status')}")


def register(app: typer.Typer) -> None:
    epilog = exit_codes_help()
    for fn, name in (
        (submit, "submit"),
        (status, "status"),
        (list_, "list"),
        (wait, "wait"),
        (download, "download"),
        (cancel, "cancel"),
    ):
        app.command(name=name, epilog=epilog)(fn)
