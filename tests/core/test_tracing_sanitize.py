"""Spans never hold a credential, whatever headers the operator asks them to capture:
``core.observability.tracing`` adds ``authorization``, ``x-api-key`` and cookies to the
instrumentations' sanitize list (beside the operator's entries) before it instruments anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.observability.tracing import CREDENTIAL_HEADERS, SANITIZE_VARIABLE, sanitize_credentials

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST"


def test_the_credentials_join_the_operators_sanitize_list() -> None:
    env = {SANITIZE_VARIABLE: ".*session.*, set-cookie"}
    value = sanitize_credentials(env)
    assert env[SANITIZE_VARIABLE] == value
    assert value.split(",") == [".*session.*", "set-cookie", *CREDENTIAL_HEADERS]
    assert sanitize_credentials(env) == value  # once is enough: nothing is added twice
    assert sanitize_credentials({}).split(",") == list(CREDENTIAL_HEADERS)
    assert sanitize_credentials({SANITIZE_VARIABLE: "Authorization"}).split(",") == [
        "Authorization",
        *[h for h in CREDENTIAL_HEADERS if h != "authorization"],
    ]


def test_setup_sanitizes_before_it_instruments(tmp_path: Path) -> None:
    """``setup`` in a process of its own (it instruments libraries for the whole process)."""
    code = (
        "import json, os; from core.observability import tracing; "
        "on = tracing.setup('test'); "
        f"print(json.dumps([on, os.environ[{SANITIZE_VARIABLE!r}]]))"
    )
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",  # nothing is exported
        OTEL_SDK_DISABLED="false",
        **{CAPTURE: ".*", SANITIZE_VARIABLE: "x-session"},
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    on, value = json.loads(out.stdout.strip().splitlines()[-1])
    assert on is True
    assert value.split(",") == ["x-session", *CREDENTIAL_HEADERS]


def _captured(monkeypatch: pytest.MonkeyPatch, sanitize: bool) -> dict[str, Any]:
    """The request-header attributes of the span of one call to an instrumented app that
    captures every request header."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv(CAPTURE, ".*")
    monkeypatch.setenv(SANITIZE_VARIABLE, "x-session")
    if sanitize:
        sanitize_credentials()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    with TestClient(app) as client:
        headers = {
            "Authorization": "Bearer sk-live-key",
            "x-api-key": "sk-ant-key",
            "Cookie": "batchd_ui=session-token",
            "x-session": "s",
            "x-trace-note": "visible",
        }
        assert client.get("/ping", headers=headers).status_code == 200
    (server,) = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    prefix = "http.request.header."
    return {
        k[len(prefix) :]: v for k, v in (server.attributes or {}).items() if k.startswith(prefix)
    }


def test_a_span_shows_no_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = _captured(monkeypatch, sanitize=True)
    for name in ("authorization", "x_api_key", "cookie", "x_session"):
        assert captured[name] == ("[REDACTED]",), (name, captured)
    assert captured["x_trace_note"] == ("visible",)


def test_without_it_the_span_would_show_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sanitizing prevents: the operator's list alone lets the key through."""
    captured = _captured(monkeypatch, sanitize=False)
    assert captured["authorization"] == ("Bearer sk-live-key",)
