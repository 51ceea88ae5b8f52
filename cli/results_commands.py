"""``batchd results`` (the lines committed so far, or followed until the batch ends),
``batchd retry`` and ``download --with-retries``: batchd's extensions beside the OpenAI
shapes (``GET /v1/batches/{id}/results``, ``POST /v1/batches/{id}/retry``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from cli.client import BatchdClient, ServerUnreachable
from cli.client_commands import (
    UNREACHABLE_GRACE_S,
    ApiKeyOpt,
    BaseUrlOpt,
    BatchIdArg,
    JsonOpt,
    PollOpt,
    TimeoutOpt,
    _client,
    _exit,
    _finish_wait,
    _print_json,
    _stderr,
    wait_for_batch,
)
from cli.exit_codes import TERMINAL_STATUSES, ExitCode, exit_codes_help
from core.results_log import MAX_PAGE
from core.retry import RETRY_KINDS, RETRY_OF, merge_with_retries

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
    with _client(base_url, api_key) as client, _Sink(output) as out:
        batch = client.get_batch(batch_id)  # a missing batch fails before anything is written
        after, total = _drain(client, batch_id, after, out)
        if not follow:
            _stderr().print(f"{total} lines ({batch.get('status')})")
            return
        start = time.monotonic()
        last_answer = start
        while batch.get("status") not in TERMINAL_STATUSES:
            if timeout is not None and time.monotonic() - start >= timeout:
                raise _exit(_finish_wait(batch, True, as_json=False))
            time.sleep(poll_interval)
            try:
                batch = client.get_batch(batch_id)
                after, n = _drain(client, batch_id, after, out)
                last_answer = time.monotonic()
            except ServerUnreachable:
                if time.monotonic() - last_answer > UNREACHABLE_GRACE_S:
                    raise
                continue
            total += n
        # The batch's end commits its last lines with it: one more pass takes them all.
        after, n = _drain(client, batch_id, after, out)
        total += n
    _stderr().print(f"{total} lines written")
    raise _exit(_finish_wait(batch, False, as_json=False))


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
            help="expired, cancelled or failed (retryable errors only); repeat for more. "
            "Default: all three.",
        ),
    ] = None,
    window: Annotated[
        str | None, typer.Option(help="Completion window (default: the parent's).")
    ] = None,
    priority: Annotated[
        str | None, typer.Option(help="high | normal | low (default: the parent's).")
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
    with _client(base_url, api_key) as client:
        batch = client.retry_batch(
            batch_id, include=include or None, completion_window=window, priority=priority
        )
        if not wait:
            if as_json:
                _print_json(batch)
            else:
                typer.echo(batch["id"])
            return
        if not as_json:
            typer.echo(batch["id"])
        _stderr().print(f"retrying {batch_id} as {batch['id']}; waiting …")
        batch, timed_out = wait_for_batch(
            client, batch["id"], poll_interval=poll_interval, timeout=timeout
        )
    raise _exit(_finish_wait(batch, timed_out, as_json=as_json))


# ------------------------------------------------------------------------------ download


def _lines(client: BatchdClient, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.file_content(file_id).splitlines() if x.strip()]


def _retries_of(client: BatchdClient, parent: dict[str, Any]) -> list[dict[str, Any]]:
    """The retries of ``parent`` and of its retries, oldest first (a retry is created after
    its parent, so the listing, newest first, stops at the parent)."""
    candidates: list[dict[str, Any]] = []
    after = None
    while True:
        page = client.list_batches(limit=100, after=after)
        data = page.get("data") or []
        candidates += [b for b in data if b.get("created_at", 0) >= parent.get("created_at", 0)]
        if (
            not page.get("has_more")
            or not data
            or data[-1].get("created_at", 0) < parent.get("created_at", 0)
        ):
            break
        after = page.get("last_id")
    family = {parent["id"]}
    chain = []
    for batch in sorted(candidates, key=lambda b: (b.get("created_at", 0), b["id"])):
        if (batch.get("metadata") or {}).get(RETRY_OF) in family:
            family.add(batch["id"])
            chain.append(batch)
    return chain


def _input_order(client: BatchdClient, batch: dict[str, Any]) -> Iterator[str]:
    for line in _lines(client, batch.get("input_file_id")):
        if isinstance(line.get("custom_id"), str):
            yield line["custom_id"]


def download_with_retries(client: BatchdClient, batch: dict[str, Any], output: Path) -> dict:
    """Write the parent's results with each line replaced by its latest retry's: one line per
    ``custom_id``, in the parent's input order."""
    chain = _retries_of(client, batch)
    layers = [
        _lines(client, batch.get("output_file_id")) + _lines(client, batch.get("error_file_id"))
    ]
    used = []
    for retry_batch in chain:
        if retry_batch.get("status") not in TERMINAL_STATUSES:
            _stderr().print(
                f"retry {retry_batch['id']} is still {retry_batch.get('status')}: not included"
            )
            continue
        used.append(retry_batch["id"])
        layers.append(
            _lines(client, retry_batch.get("output_file_id"))
            + _lines(client, retry_batch.get("error_file_id"))
        )
    merged = merge_with_retries(list(_input_order(client, batch)), layers)
    tmp = output.with_name(output.name + ".download")
    with tmp.open("wb") as out:
        for line in merged:
            out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
    tmp.replace(output)
    return {"output": str(output), "lines": len(merged), "retries": used}


def register(app: typer.Typer) -> None:
    epilog = exit_codes_help()
    app.command(name="results", epilog=epilog)(results)
    app.command(name="retry", epilog=epilog)(retry)


__all__ = ["ExitCode", "download_with_retries", "register", "results", "retry"]
