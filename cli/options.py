"""The options and arguments the client commands share (``batchd submit``, ``results``, ...)."""

from __future__ import annotations

from typing import Annotated

import typer

BaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        # Without the option, cli.client reads the variables (core.settings.ClientSettings).
        help="API base URL (env BATCHD_BASE_URL, then OPENAI_BASE_URL; "
        "default http://127.0.0.1:8000/v1).",
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help="Bearer key (env BATCHD_API_KEY, then OPENAI_API_KEY).",
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
