"""The ``batchd`` command.

``batchd up`` runs the whole service on one machine: migrations, the API, one worker (control
and model queues, threads pool, embedded beat). With no configuration it uses embedded
defaults (SQLite, Celery's SQLAlchemy transport, a local storage directory, the real chat model
SmolLM2-135M-Instruct); with ``BATCHD_*`` variables it runs the same processes against
Postgres, Redis and S3. The worker's Prometheus exporter is on, on a loopback port it prints.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.exit_codes import exit_codes_help
from cli.models import describe as describe_model
from cli.models import resolve_models
from cli.supervise import Supervisor

app = typer.Typer(
    name="batchd",
    help="Self-hosted, OpenAI-compatible batch inference.",
    epilog=exit_codes_help(),
    no_args_is_help=True,
)


def _print_version(value: bool) -> None:
    if value:
        from core.version import version

        typer.echo(f"batchd {version()}")
        raise typer.Exit()


@app.callback()
def _main(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print batchd's version and exit.",
        ),
    ] = False,
) -> None:
    """Self-hosted, OpenAI-compatible batch inference."""


def development_key(settings) -> str | None:
    """The key ``batchd up`` prints: created once for tenant "default" and kept (mode 0600) in
    ``BATCHD_HOME/dev-key``, so restarts print the same key instead of minting new ones."""
    from core.database import auth
    from core.database.sessions import session_scope

    path = settings.home / "dev-key"
    with session_scope(settings.database_url) as session:
        if path.exists():
            saved = path.read_text().strip()
            if saved and auth.lookup(session, saved) is not None:
                return saved
        _row, plaintext = auth.create_key(session, "default", "development key (batchd up)")
    path.touch(mode=0o600)
    path.write_text(plaintext + "\n")
    return plaintext


MAX_DEFAULT_API_WORKERS = 4


def api_workers(settings, requested: int | None = None) -> int:
    """How many API processes ``batchd up`` runs: ``requested`` (``--api-workers``), else
    ``BATCHD_API_WORKERS``, else min(4, CPUs) on a database server and a Redis broker, and 1
    on embedded defaults (SQLite takes one writer at a time; without Redis each process
    counts rate limits on its own)."""
    count = requested or settings.api_workers
    if count:
        return count
    if settings.uses_embedded_defaults or not settings.broker_url.startswith(
        ("redis://", "rediss://")
    ):
        return 1
    return max(1, min(MAX_DEFAULT_API_WORKERS, len(os.sched_getaffinity(0))))


def api_metrics_env(settings, workers: int, directory: Path | None = None) -> dict[str, str]:
    """Several API processes count in prometheus-client's multiprocess mode: each writes its
    counters to files in ``directory`` (default ``BATCHD_HOME/api-metrics``; the files of an
    earlier run are removed here, at start), and ``/metrics`` of whichever process answers
    sums every process's (api/prometheus.py). The API's alone: the worker's exporter must not add
    the API's counters to its own."""
    if workers < 2 or not settings.metrics_enabled:
        return {}
    directory = directory or settings.home / "api-metrics"
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink(missing_ok=True)
    return {"PROMETHEUS_MULTIPROC_DIR": str(directory)}


WORKER_METRICS_PORT = 9101


def worker_metrics_env(settings) -> dict[str, str]:
    """``batchd up`` turns its worker's metrics exporter on, on loopback: port 9101, or a free
    one when that is taken. Nothing when metrics are off or the environment names a port.
    The exporter's address is ``worker_metrics_host`` when that is set, else loopback (not
    the setting's default, every interface)."""
    if not settings.metrics_enabled or "worker_metrics_port" in settings.model_fields_set:
        return {}
    given = "worker_metrics_host" in settings.model_fields_set
    host = settings.worker_metrics_host if given else "127.0.0.1"
    port = WORKER_METRICS_PORT
    for candidate in (WORKER_METRICS_PORT, 0):
        with socket.socket() as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
            port = sock.getsockname()[1]
            break
    return {"BATCHD_WORKER_METRICS_PORT": str(port), "BATCHD_WORKER_METRICS_HOST": host}


ApiWorkersOption = Annotated[
    int | None,
    typer.Option(
        "--api-workers",
        min=1,
        help="API processes (default: BATCHD_API_WORKERS, else min(4, CPUs) on Postgres and "
        "Redis, 1 on embedded defaults).",
    ),
]


@app.command("api")
def api(
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the API listens on.")] = 8000,
    api_workers_option: ApiWorkersOption = None,
) -> None:
    """Run the API alone, as many processes as `batchd up` would (the compose file's api
    service); migrations are a step of their own."""
    from core import launch
    from core.settings import get_settings

    settings = get_settings()
    count = api_workers(settings, api_workers_option)
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    env = dict(os.environ, **api_metrics_env(settings, count, Path(given) if given else None))
    cmd = launch.api_command(port, host, workers=count)
    typer.echo(f"batchd api: {count} API process{'es' if count > 1 else ''} on {host}:{port}")
    sys.stdout.flush()  # exec replaces the process: what is buffered would be lost
    os.execve(cmd[0], cmd, env)


@app.command()
def up(
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the API listens on.")] = 8000,
    workers: Annotated[bool, typer.Option(help="Also run a worker and beat here.")] = True,
    api_workers_option: ApiWorkersOption = None,
) -> None:
    """Run the API, a worker and the beat scheduler; one that exits is started again; Ctrl-C
    stops them all."""
    import migrations
    from core import launch
    from core.settings import get_settings

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    typer.echo(f"batchd home: {settings.home}")
    typer.echo("applying database migrations …")
    migrations.upgrade(settings.database_url)
    try:
        resolved = resolve_models(settings.models, say=typer.echo)
    except ValueError as exc:  # a model whose files cannot be served: named, nothing started
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for name, path in resolved.items():
        typer.echo(describe_model(name, settings.models[name], path))

    env = dict(os.environ, BATCHD_HOME=str(settings.home))
    metrics_env = worker_metrics_env(settings) if workers else {}
    env.update(metrics_env)
    commands: dict[str, list[str]] = {}
    if workers:
        info = ["--loglevel", "INFO"]
        commands["worker"] = launch.control_and_model_worker_command(
            settings.models, settings.worker_shard_concurrency + 2, launch.node_name("batchd"),
            extra=info,
        )  # fmt: skip
        # Beat as a child of its own, not the worker's ``-B``: an embedded beat is a process
        # the worker forks, which outlives a worker killed with SIGKILL (and runs beside the
        # restarted worker's own).
        commands["beat"] = launch.beat_command(settings.home / "celerybeat-schedule", extra=info)
    api_processes = api_workers(settings, api_workers_option)
    commands["api"] = launch.api_command(port, host, workers=api_processes)
    # A child that exits while nobody asked it to is started again (cli/supervise.py).
    supervisor = Supervisor(
        commands,
        env,
        child_env={"api": api_metrics_env(settings, api_processes)},
        echo=lambda line: typer.echo(line, err=True),
    )
    supervisor.start()
    try:
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        typer.echo(f"\nbatchd is up: base URL http://{shown_host}:{port}/v1")
        typer.echo(f"dashboard: http://{shown_host}:{port}/ui")
        typer.echo(f"API processes: {api_processes}")
        if api_processes > 1 and not settings.broker_url.startswith(("redis://", "rediss://")):
            typer.echo("  without Redis each API process counts the rate limit on its own")
        if metrics_env:
            typer.echo(
                f"metrics (Prometheus): http://{shown_host}:{port}/metrics (API), http://"
                f"{metrics_env['BATCHD_WORKER_METRICS_HOST']}:"
                f"{metrics_env['BATCHD_WORKER_METRICS_PORT']}/metrics (worker)"
            )
        if settings.auth.strip().lower() in {"off", "false", "0", "no", "disabled"}:
            typer.echo("Authentication is off (BATCHD_AUTH=off): any key works.")
        else:
            typer.echo(f"development API key (tenant 'default'): {development_key(settings)}")
            typer.echo(
                f"  export OPENAI_BASE_URL=http://{shown_host}:{port}/v1 OPENAI_API_KEY=<that key>"
            )
        supervisor.run()
    except KeyboardInterrupt:
        pass
    finally:
        typer.echo("batchd up: stopping …", err=True)
        clean = supervisor.stop(grace_s=20)
    if not clean:
        raise typer.Exit(1)


def _register_commands() -> None:
    from cli import client_commands, results_commands, run
    from cli.admin import keys_app
    from cli.perf import commands as perf

    client_commands.register(app)
    results_commands.register(app)
    run.register(app)
    perf.register(app)
    app.add_typer(keys_app, name="keys")


_register_commands()


if __name__ == "__main__":
    app()
