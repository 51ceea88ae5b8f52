"""One source of configuration: every ``BATCHD_*`` variable is read through ``core.settings``,
and docs/configuration.md is what ``core.settings`` generates from its fields."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.settings import REGENERATE, ClientSettings, Settings, get_settings, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
PRODUCT = ("api", "core", "worker", "engine", "cli")
#: The one module that may read them.
SETTINGS_MODULE = Path("core/settings.py")
#: The variables these tests set, cleared first so the machine's environment cannot leak in.
VARIABLES = (
    "BATCHD_MODEL_CACHE",
    "BATCHD_RELEASE_RESEND_AFTER_S",
    "BATCHD_RELEASE_SWEEP_INTERVAL_S",
    "BATCHD_SHARD_STALE_AFTER_S",
    "BATCHD_WEBHOOK_BACKOFF_S",
    "BATCHD_WEBHOOK_BACKOFF_MAX_S",
    "BATCHD_WORKER_METRICS_HOST",
    "BATCHD_WORKER_METRICS_PORT",
    "BATCHD_METRICS_ENABLED",
    "BATCHD_BASE_URL",
    "BATCHD_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
)


# The generated reference.


def test_the_configuration_doc_is_what_the_settings_generate() -> None:
    expected = reference_markdown()
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if current != expected:
        diff = difflib.unified_diff(
            current.splitlines(), expected.splitlines(), "docs/configuration.md", "generated",
            lineterm="", n=0,
        )  # fmt: skip
        shown = "\n".join(list(diff)[:30])
        pytest.fail(
            f"docs/configuration.md is out of date with core/settings.py; regenerate it with\n"
            f"    {REGENERATE}\n{shown}",
            pytrace=False,
        )


def test_the_generator_runs_as_documented() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "core.settings"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert printed == reference_markdown()


def test_every_setting_is_described_and_listed() -> None:
    doc = reference_markdown()
    for model in (Settings, ClientSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
    for name in Settings.model_fields:
        assert f"| `BATCHD_{name.upper()}` |" in doc
    for variable in ("BATCHD_BASE_URL", "OPENAI_BASE_URL", "BATCHD_API_KEY", "OPENAI_API_KEY"):
        assert f"`{variable}`" in doc


# No BATCHD_* read outside core/settings.py.


def _environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _batchd(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("BATCHD_")
    )


def environment_reads(source: str, filename: str = "<source>") -> list[int]:
    """Lines of ``source`` that read a ``BATCHD_*`` variable from the environment:
    ``os.environ["BATCHD_X"]`` (not an assignment to it), ``os.environ.get("BATCHD_X")``,
    ``os.getenv("BATCHD_X")``, ``"BATCHD_X" in os.environ``, and a click/typer option's
    ``envvar="BATCHD_X"``. Building a child's environment (``dict(os.environ, BATCHD_X=...)``,
    ``env["BATCHD_X"] = ...``) is no read."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Subscript):
            read = isinstance(node.ctx, ast.Load) and _environ(node.value) and _batchd(node.slice)
        elif isinstance(node, ast.Call):
            func = node.func
            getter = (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            )
            getter |= (
                isinstance(func, ast.Attribute) and func.attr == "get" and _environ(func.value)
            )
            read = bool(getter and node.args and _batchd(node.args[0]))
            read |= any(
                keyword.arg == "envvar" and any(_batchd(n) for n in ast.walk(keyword.value))
                for keyword in node.keywords
            )
        elif isinstance(node, ast.Compare):
            read = (
                _batchd(node.left)
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                and any(_environ(c) for c in node.comparators)
            )
        else:
            read = False
        if read:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_reads_and_skips_writes() -> None:
    source = """
import os
from os import environ, getenv
a = os.environ.get("BATCHD_A", "1")
b = os.environ["BATCHD_B"]
c = os.getenv("BATCHD_C")
d = "BATCHD_D" in os.environ
e = getenv("BATCHD_E") or environ.get("BATCHD_F")
option = typer.Option("--x", envvar=["BATCHD_G", "OTHER"])
os.environ["BATCHD_H"] = "1"
env = dict(os.environ, BATCHD_HOME="/tmp/home")
env["BATCHD_I"] = env.get("BATCHD_J", "")
other = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
"""
    assert environment_reads(source) == [4, 5, 6, 7, 8, 8, 9]


def test_no_product_module_reads_a_batchd_variable_outside_the_settings() -> None:
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative == SETTINGS_MODULE or "__pycache__" in relative.parts:
                continue
            source = path.read_text(encoding="utf-8")
            found += [f"{relative}:{line}" for line in environment_reads(source, str(relative))]
    assert not found, (
        "BATCHD_* variables read outside core/settings.py (add a field to Settings, or to "
        "ClientSettings for the command line's client side, and read it there): " + ", ".join(found)
    )


# The settings moved into Settings are honoured.


@pytest.fixture
def setenv(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Set (a value) or unset (None) variables, then drop the cached settings."""

    def set_variables(**values: str | None) -> None:
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    set_variables(**dict.fromkeys(VARIABLES))
    yield set_variables
    get_settings.cache_clear()


def test_webhook_backoff(setenv: Callable[..., None]) -> None:
    from worker.batches.webhooks import backoff_s

    assert [backoff_s(n) for n in (1, 2, 3)] == [30.0, 60.0, 120.0]
    assert backoff_s(20) == 3600.0
    setenv(BATCHD_WEBHOOK_BACKOFF_S="2", BATCHD_WEBHOOK_BACKOFF_MAX_S="5")
    assert [backoff_s(n) for n in (1, 2, 3)] == [2.0, 4.0, 5.0]


def test_model_cache(setenv: Callable[..., None], tmp_path: Path) -> None:
    from core.llms import demo, gguf

    default = Path.home() / ".cache" / "batchd" / "models"
    assert demo.cache_root() == gguf.cache_root() == default
    setenv(BATCHD_MODEL_CACHE=str(tmp_path / "models"))
    assert demo.cache_root() == gguf.cache_root() == tmp_path / "models"
    setenv(BATCHD_MODEL_CACHE="~/elsewhere")
    assert demo.cache_root() == gguf.cache_root() == Path.home() / "elsewhere"


def test_release_resend_after(setenv: Callable[..., None]) -> None:
    from worker.shards.release import resend_after_s

    assert resend_after_s() == 600.0  # max(600, 10 x the default 30 s)
    setenv(BATCHD_SHARD_STALE_AFTER_S="120")
    assert resend_after_s() == 1200.0
    setenv(BATCHD_RELEASE_RESEND_AFTER_S="7")
    assert resend_after_s() == 7.0
    setenv(BATCHD_RELEASE_RESEND_AFTER_S="")  # empty, as before: the derived bound
    assert resend_after_s() == 1200.0


def test_release_sweep_interval(setenv: Callable[..., None]) -> None:
    from worker.infra.celery import create_app

    assert create_app().conf.beat_schedule["release-shards"]["schedule"] == 5.0
    setenv(BATCHD_RELEASE_SWEEP_INTERVAL_S="1")
    assert create_app().conf.beat_schedule["release-shards"]["schedule"] == 1.0


def test_batchd_up_worker_metrics_address(setenv: Callable[..., None]) -> None:
    from cli.main import worker_metrics_env

    # `batchd up` keeps its exporter on loopback unless told otherwise (the setting's own
    # default is every interface).
    assert get_settings().worker_metrics_host == "0.0.0.0"
    assert worker_metrics_env(get_settings())["BATCHD_WORKER_METRICS_HOST"] == "127.0.0.1"
    setenv(BATCHD_WORKER_METRICS_HOST="localhost")
    assert worker_metrics_env(get_settings())["BATCHD_WORKER_METRICS_HOST"] == "localhost"
    setenv(BATCHD_WORKER_METRICS_PORT="9200")  # a port given: `batchd up` adds nothing
    assert worker_metrics_env(get_settings()) == {}


def test_client_base_url_and_key(setenv: Callable[..., None]) -> None:
    from cli.client import resolve_api_key, resolve_base_url

    assert resolve_base_url(None) == "http://127.0.0.1:8000/v1"
    assert resolve_api_key(None) is None
    setenv(OPENAI_BASE_URL="http://openai.test/v1/", OPENAI_API_KEY="sk-openai")
    assert resolve_base_url(None) == "http://openai.test/v1"
    assert resolve_api_key(None) == "sk-openai"
    setenv(BATCHD_BASE_URL="", BATCHD_API_KEY="")  # empty: unset, as before
    assert resolve_base_url(None) == "http://openai.test/v1"
    assert resolve_api_key(None) == "sk-openai"
    setenv(BATCHD_BASE_URL="http://batchd.test/v1", BATCHD_API_KEY="sk-batchd")
    assert resolve_base_url(None) == "http://batchd.test/v1"
    assert resolve_api_key(None) == "sk-batchd"
    assert resolve_base_url("http://option.test/v1") == "http://option.test/v1"
    assert resolve_api_key("sk-option") == "sk-option"
