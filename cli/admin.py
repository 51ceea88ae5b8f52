"""``batchd keys``: create, list and revoke API keys.

These talk to the database directly (``BATCHD_DATABASE_URL``), not to the API: they run where
the database is reachable, by whoever administers the service. A key is printed once, when it
is created; only its hash is stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated

import typer
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cli.exit_codes import ExitCode
from core.batches.priority import Priority

keys_app = typer.Typer(
    name="keys",
    help="Create, list and revoke API keys (talks to the database directly).",
    no_args_is_help=True,
    add_completion=False,
)


@contextmanager
def _session() -> Iterator[Session]:
    from core.database.sessions import session_scope
    from core.settings import get_settings

    url = get_settings().database_url
    try:
        with session_scope(url) as session:
            yield session
    except SQLAlchemyError as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        typer.echo(
            f"error: database {_safe_url(url)}: {message}\n"
            "(is BATCHD_DATABASE_URL right, and have migrations run? `alembic upgrade head`)",
            err=True,
        )
        raise typer.Exit(ExitCode.ERROR) from error


def _safe_url(url: str) -> str:
    """The URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable URL>"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option(help="The tenant whose files and batches the key sees.")],
    name: Annotated[str, typer.Option(help="A label for listings.")] = "",
    webhook_url: Annotated[
        str | None,
        typer.Option(help="Default webhook for batches created with this key (http/https)."),
    ] = None,
    max_priority: Annotated[
        Priority,
        typer.Option(
            help="The highest batch priority the key may ask for; a create above it is "
            "refused (403 priority_not_allowed). Admin keys (BATCHD_ADMIN_API_KEYS) may use any."
        ),
    ] = Priority.NORMAL,
    min_completion_window: Annotated[
        str | None,
        typer.Option(
            help="The shortest completion window the key may ask for, e.g. 6h; a create "
            "below it is refused (403 completion_window_not_allowed). Default: any."
        ),
    ] = None,
) -> None:
    """Create a key and print it (once: only its hash is stored) with its webhook secret."""
    from core.batches.completion_windows import window_seconds
    from core.database.auth import create_key, webhook_url_problem

    if webhook_url is not None and (problem := webhook_url_problem(webhook_url)):
        typer.echo(f"error: --webhook-url {problem}", err=True)
        raise typer.Exit(ExitCode.USAGE)
    shortest = None
    if min_completion_window is not None:
        shortest = window_seconds(min_completion_window)
        if shortest is None:
            typer.echo(
                f"error: --min-completion-window {min_completion_window!r}: expected a "
                'duration like "1h", "90m", "2d"',
                err=True,
            )
            raise typer.Exit(ExitCode.USAGE)
    try:
        with _session() as session:
            row, plaintext = create_key(
                session,
                tenant,
                name,
                webhook_url=webhook_url,
                max_priority=max_priority.value,
                min_completion_window_s=shortest,
            )
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(ExitCode.USAGE) from error
    windows = ""
    if row.min_completion_window_s is not None:
        windows = f", completion windows of at least {min_completion_window}"
    typer.echo(
        f"Created key {row.id} for tenant {row.tenant!r} (priorities up to {row.max_priority}"
        f"{windows})."
    )
    typer.echo(f"API key:        {plaintext}")
    typer.echo(f"Webhook secret: {row.webhook_secret}")
    if row.webhook_url:
        typer.echo(f"Webhook URL:    {row.webhook_url}")
    typer.echo(
        "Store the key now: it is not shown again. Webhook deliveries for batches created "
        "with this key are signed with the webhook secret.",
        err=True,
    )


@keys_app.command("list")
def list_(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List keys (never the keys themselves: their first characters)."""
    from rich.console import Console
    from rich.table import Table

    from core.database.auth import list_keys

    with _session() as session:
        rows = list_keys(session, tenant)
    table = Table(
        "id", "tenant", "name", "prefix", "created", "last used", "revoked", "max priority"
    )
    for row in rows:
        table.add_row(
            row.id,
            row.tenant,
            row.name or "",
            row.prefix + "…",
            _when(row.created_at),
            _when(row.last_used_at),
            _when(row.revoked_at),
            row.max_priority,
        )
    Console(width=200).print(table)


@keys_app.command("revoke")
def revoke(key_id: Annotated[str, typer.Argument(help="The key's id (see `keys list`).")]) -> None:
    """Revoke a key: requests with it are refused from now on."""
    from core.database.auth import revoke_key

    with _session() as session:
        row = revoke_key(session, key_id)
        revoked_at = None if row is None else row.revoked_at
    if row is None:
        typer.echo(f"error: no such key: {key_id}", err=True)
        raise typer.Exit(ExitCode.ERROR)
    typer.echo(f"Revoked key {key_id} (tenant {row.tenant!r}) at {_when(revoked_at)}.")
