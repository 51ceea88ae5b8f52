"""The client commands for pipelines: submit, status, list, wait, download, cancel, pause
and resume.

What goes to standard output and standard error, and the exit codes: :mod:`cli.console`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli import estimate_commands
from cli.client import BatchdClient
from cli.console import (
    api_client,
    batch_errors,
    counts,
    error_text,
    escape,
    exit_with,
    print_json,
    stderr,
    stdout,
)
from cli.downloads import download_results, download_with_retries
from cli.exit_codes import TERMINAL_STATUSES, ExitCode, exit_codes_help
from cli.options import ApiKeyOpt, BaseUrlOpt, BatchIdArg, JsonOpt, PollOpt, TimeoutOpt
from cli.waiting import announce_and_wait, finish_wait, wait_for_batch
from core.batchfile.reader import file_endpoint
from core.batchfile.request import CHAT_URL, LineError
from core.database.lifecycle import BatchStatus


def _parse_metadata(items: list[str] | None) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--metadata")
        metadata[key] = value
    return metadata


def _when(ts: Any) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%d %H:%M:%SZ")


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
    max_total_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="A token budget: the prompt plus output tokens the batch may spend; lines "
            "not started once it is spent end as budget_exhausted errors.",
        ),
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
        with api_client(base_url, api_key) as client:
            code = estimate_commands.dry_run(
                client, file, endpoint=endpoint, window=window, as_json=as_json
            )
        raise exit_with(code)
    with api_client(base_url, api_key) as client:
        uploaded = client.upload_file(file)
        batch = client.create_batch(
            uploaded["id"],
            endpoint=endpoint,
            completion_window=window,
            metadata=meta,
            idempotency_key=idempotency_key,
            max_total_tokens=max_total_tokens,
        )
        waited = announce_and_wait(
            client, batch, wait=wait, as_json=as_json,
            note=f"submitted {batch['id']} (input {uploaded['id']})",
            poll_interval=poll_interval, timeout=timeout,
        )  # fmt: skip
        if waited is None:
            return
        batch, timed_out = waited
        code = finish_wait(batch, timed_out, as_json=as_json)
        wanted = output is not None or errors is not None
        if wanted and not timed_out and _has_results(batch):
            download_results(client, batch, output, errors)
            wrote = " and ".join(str(p) for p in (output, errors) if p is not None)
            stderr().print(f"wrote {wrote}")
    raise exit_with(code)


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
        stderr().print(f"endpoint {found[0]} (from line {found[1]}'s url; --endpoint to set it)")
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
        stderr().print(
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
    with api_client(base_url, api_key) as client:
        batch = client.get_batch(batch_id)
    if as_json:
        print_json(batch)
        return
    completed, failed, total = counts(batch)
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
    if batch.get("paused"):
        rows.append(("paused", f"since {_when(batch.get('paused_at'))} (`batchd resume`)"))
    if batch.get("max_total_tokens") is not None:
        spent = (batch.get("usage") or {}).get("total_tokens", 0)
        rows.append(("token budget", f"{spent} of {batch['max_total_tokens']} spent"))
    if batch.get("metadata"):
        rows.append(("metadata", json.dumps(batch["metadata"])))
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    stdout().print(table)
    for e in batch_errors(batch)[:10]:
        stdout().print(escape(f"  {error_text(e)}"))


def list_(
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many batches.")] = 20,
    after: Annotated[str | None, typer.Option(help="Page after this batch id.")] = None,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """List recent batches, newest first."""
    with api_client(base_url, api_key) as client:
        page = client.list_batches(limit=limit, after=after)
    if as_json:
        print_json(page)
        return
    console = stdout()
    console.print(_batch_table(page.get("data", []), console.width))
    if page.get("has_more"):
        stderr().print(f"more: --after {page.get('last_id')}")


# The columns of `batchd list`, and the order in which a narrow terminal drops them: ids and
# statuses are never cut (a truncated id cannot be pasted into the next command).
_LIST_COLUMNS = ("id", "status", "completed", "failed", "total", "endpoint", "created")
_LIST_DROP_ORDER = ("endpoint", "created", "failed", "total", "completed")


def _batch_table(batches: list[dict[str, Any]], width: int) -> Table:
    """The table of ``batchd list``, with as many columns as fit in ``width`` whole."""
    rows = []
    for batch in batches:
        completed, failed, total = counts(batch)
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
    with api_client(base_url, api_key) as client:
        batch, timed_out = wait_for_batch(
            client, batch_id, poll_interval=poll_interval, timeout=timeout
        )
    raise exit_with(finish_wait(batch, timed_out, as_json=as_json))


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
    with api_client(base_url, api_key) as client:
        batch = client.get_batch(batch_id)
        if batch.get("status") not in TERMINAL_STATUSES:
            stderr().print(
                f"[bold red]error:[/] batch {batch_id} is {batch.get('status')}; it has no "
                f"results yet (wait for it: batchd wait {batch_id})"
            )
            raise exit_with(ExitCode.ERROR)
        if not _has_results(batch):
            raise exit_with(ExitCode.FAILED)
        if with_retries:
            merged = download_with_retries(client, batch, output)
            if as_json:
                print_json(merged)
            else:
                stderr().print(
                    f"wrote {output} ({merged['lines']} lines, retries: "
                    f"{', '.join(merged['retries']) or 'none'})"
                )
            return
        written = download_results(client, batch, output, errors)
    if as_json:
        print_json(written)
    else:
        stderr().print(
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
    _batch_verb(BatchdClient.cancel_batch, batch_id, as_json, base_url, api_key)


def _batch_verb(
    verb: Callable[[BatchdClient, str], dict[str, Any]],
    batch_id: str,
    as_json: bool,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Call ``verb`` (cancel, pause, resume) on the batch and print it: id, status, paused."""
    with api_client(base_url, api_key) as client:
        batch = verb(client, batch_id)
    if as_json:
        print_json(batch)
    else:
        typer.echo(
            f"{batch.get('id')} {batch.get('status')}" + (" paused" if batch.get("paused") else "")
        )


def pause(
    batch_id: BatchIdArg,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Pause a batch: its requests in flight finish, no new ones start until it is resumed.
    Its completion window keeps running."""
    _batch_verb(BatchdClient.pause_batch, batch_id, as_json, base_url, api_key)


def resume(
    batch_id: BatchIdArg,
    as_json: JsonOpt = False,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Resume a paused batch from where it stopped."""
    _batch_verb(BatchdClient.resume_batch, batch_id, as_json, base_url, api_key)


def register(app: typer.Typer) -> None:
    epilog = exit_codes_help()
    for fn, name in (
        (submit, "submit"),
        (status, "status"),
        (list_, "list"),
        (wait, "wait"),
        (download, "download"),
        (cancel, "cancel"),
        (pause, "pause"),
        (resume, "resume"),
    ):
        app.command(name=name, epilog=epilog)(fn)
