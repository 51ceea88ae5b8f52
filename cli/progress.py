"""The progress bar the CLI draws on standard error: a label, the bar, done of total, what
the caller adds (failures, a rate), elapsed time and an ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def requests_progress(
    label: str, *fields: str, console: Console, enabled: bool, transient: bool = False
) -> Progress:
    """``label`` and ``fields`` are rich text column formats (``{task.fields[…]}``)."""
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        *(TextColumn(f) for f in fields),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
        disable=not enabled,
    )
