"""``batchd submit --dry-run FILE``: what a submit would make of a file, creating nothing.

It uploads the file, asks for its estimate (``POST /v1/batches/estimate``), deletes the
upload, and prints what a submit would make of it and when it would be done."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli.client import BatchdClient
from cli.exit_codes import ExitCode

#: Errors printed (the JSON output carries every one the server listed).
SHOWN_ERRORS = 10


def dry_run(
    client: BatchdClient, file: Path, *, endpoint: str, window: str, as_json: bool
) -> ExitCode:
    """Print FILE's estimate; ``ExitCode.FAILED`` when it would fail validation."""
    uploaded = client.upload_file(file)
    try:
        estimate = client.estimate_batch(
            uploaded["id"], endpoint=endpoint, completion_window=window
        )
    finally:
        client.delete_file(uploaded["id"])
    if as_json:
        print(json.dumps(estimate, indent=2))
    else:
        print_estimate(estimate, Console(highlight=False, soft_wrap=True), str(file))
    return ExitCode.FAILED if estimate.get("errors") else ExitCode.OK


def _when(ts: int | None) -> str:
    if ts is None:
        return "-"
    moment = datetime.fromtimestamp(ts, UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def eta_text(ts: int | None, at_risk: bool | None = None) -> str:
    """An ETA for ``batchd status`` and the dry run: the time, and how far ahead it is."""
    if ts is None:
        return "-"
    seconds = ts - int(datetime.now(UTC).timestamp())
    ahead = f"in {_span(seconds)}" if seconds >= 0 else f"{_span(-seconds)} ago"
    risk = " (at risk: after its deadline)" if at_risk else ""
    return f"{_when(ts)} ({ahead}){risk}"


def _span(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


def print_estimate(estimate: dict[str, Any], console: Console, name: str) -> None:
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    fits = estimate.get("fits_window")
    fit_text = {True: "fits", False: "does NOT fit", None: "unknown"}[fits]
    rows = [
        ("file", name),
        ("endpoint", estimate.get("endpoint")),
        ("model", estimate.get("model") or "-"),
        (
            "requests",
            f"{estimate['valid_requests']} valid of {estimate['total_requests']}"
            + (f", {len(estimate['errors'])} errors listed" if estimate.get("errors") else ""),
        ),
        ("prompt tokens", f"{estimate['prompt_tokens']:,} (the model's tokenizer)"),
        ("max completion tokens", f"{estimate['max_completion_tokens']:,}"),
        # prompt tokens an earlier line holds as a prefix (docs/validation.md#the-prefix-plan)
        ("shareable prefix", f"{estimate.get('predicted_shareable_tokens', 0):,} prompt tokens"),
        ("queue ahead", f"{estimate['queue_ahead_tokens']:,} tokens"),
        ("estimated start", eta_text(estimate.get("estimated_start_at"))),
        ("estimated completion", eta_text(estimate.get("estimated_completion_at"))),
        ("deadline", f"{_when(estimate.get('expires_at'))} ({estimate.get('completion_window')})"),
        ("window", fit_text),
    ]
    for model, figures in (estimate.get("per_model") or {}).items():
        rate = figures.get("throughput_tokens_per_s")
        shown = "none observed recently" if rate is None else f"{rate:,.0f} tokens/s recently"
        rows.append((f"{model} throughput", shown))
    if estimate.get("reason"):
        rows.append(("note", estimate["reason"]))
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    console.print(table)
    errors = estimate.get("errors") or []
    for error in errors[:SHOWN_ERRORS]:
        where = f"line {error['line']}: " if error.get("line") is not None else ""
        console.print(escape(f"  {where}{error.get('code')}: {error.get('message')}"))
    if len(errors) > SHOWN_ERRORS:
        console.print(f"  … {len(errors) - SHOWN_ERRORS} more (--json lists them all)")
