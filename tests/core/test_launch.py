"""The command lines of the service's processes (core.launch), as each launcher resolves them,
and that nothing else in the tree builds one."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import launch
from core.settings import get_settings

REPO = Path(__file__).resolve().parents[2]
CELERY = [sys.executable, "-m", "celery", "-A", "worker.infra.celery"]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_api_command() -> None:
    argv = launch.api_command(8123)
    assert argv == [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "127.0.0.1",
                    "--port", "8123"]  # fmt: skip
    argv = launch.api_command(9000, "0.0.0.0", workers=4, log_level="warning")
    assert option(argv, "--host") == "0.0.0.0"
    assert option(argv, "--workers") == "4"
    assert option(argv, "--log-level") == "warning"
    assert "--workers" not in launch.api_command(9000, workers=1)  # one process: no manager


def test_control_worker_consumes_the_control_queue_on_threads() -> None:
    argv = launch.control_worker_command("control@h", extra=launch.QUIET)
    assert argv[: len(CELERY) + 1] == [*CELERY, "worker"]
    assert option(argv, "-Q") == "batchd.control"
    assert option(argv, "--pool") == "threads"
    assert option(argv, "-c") == "2"
    assert option(argv, "-n") == "control@h"
    assert argv[-len(launch.QUIET) :] == list(launch.QUIET)
    assert option(launch.control_worker_command("c@h", pool="prefork"), "--pool") == "prefork"


def test_model_and_dispatch_workers_consume_their_models_queues() -> None:
    argv = launch.model_worker_command(["chat", "odd name"], 6, "model@h")
    assert option(argv, "-Q") == "batchd.model.chat,batchd.model.odd_name"
    assert option(argv, "--pool") == "threads"
    assert option(argv, "-c") == "6"
    argv = launch.dispatch_worker_command(["fleet"], 4, "dispatch@h")
    assert option(argv, "-Q") == "batchd.model.fleet"
    argv = launch.control_and_model_worker_command(["chat"], 10, "all@h")
    assert option(argv, "-Q") == "batchd.control,batchd.model.chat"


def test_beat_and_python_m_worker() -> None:
    argv = launch.beat_command(Path("/x/schedule"), extra=["--loglevel", "INFO"])
    assert argv == [*CELERY, "beat", "-s", "/x/schedule", "--loglevel", "INFO"]
    python_m_worker = [sys.executable, "-m", "worker"]
    assert launch.worker_module_command("control") == [*python_m_worker, "control"]
    assert launch.worker_module_command("model", ["a", "b"], extra=["-l", "INFO"]) == [
        *python_m_worker, "model", "a", "b", "--", "-l", "INFO",
    ]  # fmt: skip


def test_node_name_is_unique_per_process() -> None:
    assert launch.node_name("model").startswith("model-")
    assert launch.node_name("model").endswith("@%h")


def test_service_env() -> None:
    env = launch.service_env(
        Path("/w"), "postgresql://db", "redis://b", {"chat": "demo:llama-tiny"},
        base={"KEEP": "1", "BATCHD_HOME": "/elsewhere"}, BATCHD_MODELS="{}",
    )  # fmt: skip
    assert env["KEEP"] == "1"
    assert env["BATCHD_HOME"] == "/w/home"
    assert env["BATCHD_STORAGE_URL"] == "/w/storage"
    assert env["BATCHD_DATABASE_URL"] == "postgresql://db"
    assert env["BATCHD_BROKER_URL"] == "redis://b"
    assert env["BATCHD_MODELS"] == "{}"  # overrides win
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    models = {"chat": "demo:llama-tiny", "fleet": "upstream:http://127.0.0.1:9/v1"}
    monkeypatch.setenv("BATCHD_MODELS", json.dumps(models))
    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))
    monkeypatch.setenv("BATCHD_WORKER_SHARD_CONCURRENCY", "5")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_python_m_worker_resolves_each_role_from_the_settings(served: None, tmp_path: Path) -> None:
    from worker.__main__ import command

    control = command("control", [])
    assert option(control, "-Q") == "batchd.control"
    assert option(control, "-n").startswith("control-")
    model = command("model", [])
    assert option(model, "-Q") == "batchd.model.chat,batchd.model.fleet"
    assert option(model, "-c") == "5"
    assert option(command("model", ["chat"]), "-Q") == "batchd.model.chat"
    dispatch = command("dispatch", [])
    assert option(dispatch, "-Q") == "batchd.model.fleet"
    assert option(dispatch, "-n").startswith("dispatch-")
    assert command("beat", []) == [*CELERY, "beat", "-s", str(tmp_path / "celerybeat-schedule")]
    with pytest.raises(SystemExit, match="not an upstream model"):
        command("dispatch", ["chat"])
    with pytest.raises(SystemExit, match="not served"):
        command("model", ["nope"])


# -- nothing else builds a command line of the service's processes

# This file states the command lines it expects; test_compose reads the compose file's.
ALLOWED = {Path("core/launch.py"), Path("tests/core/test_launch.py"), Path("tests/test_compose.py")}
PROGRAMS = {"celery", "uvicorn", "worker"}
APPS = {"worker.infra.celery", "api.app:app"}


def _strings(node: ast.List | ast.Tuple) -> list[str]:
    return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _builds_a_command_line(node: ast.AST) -> bool:
    """A list or tuple display that holds ``-m celery|uvicorn|worker`` or names the Celery
    or the API app (``-A worker.infra.celery``, ``api.app:app``)."""
    if not isinstance(node, ast.List | ast.Tuple):
        return False
    strings = _strings(node)
    if APPS & set(strings):
        return True
    return any(a == "-m" and b in PROGRAMS for a, b in zip(strings, strings[1:], strict=False))


def test_no_other_module_builds_a_service_command_line() -> None:
    offenders = []
    for folder in ("api", "benchmarks", "cli", "core", "engine", "migrations", "scripts",
                   "tests", "worker"):  # fmt: skip
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO)
            if relative in ALLOWED:
                continue
            tree = ast.parse(path.read_text(), str(relative))
            offenders += [
                f"{relative}:{node.lineno}"
                for node in ast.walk(tree)
                if _builds_a_command_line(node)
            ]
    assert not offenders, f"command lines built outside core/launch.py: {offenders}"


def test_the_scan_finds_a_command_line() -> None:
    built = ast.parse('cmd = [sys.executable, "-m", "celery", "-A", "worker.infra.celery"]')
    assert any(_builds_a_command_line(n) for n in ast.walk(built))
    built = ast.parse('cmd = [sys.executable, "-m", "uvicorn", app]')
    assert any(_builds_a_command_line(n) for n in ast.walk(built))
    assert not any(
        _builds_a_command_line(n) for n in ast.walk(ast.parse('[sys.executable, "-m", "cli"]'))
    )
