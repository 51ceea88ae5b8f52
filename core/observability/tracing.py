"""Optional OpenTelemetry traces, off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

With the ``otel`` extra and the endpoint, each process exports its spans over OTLP/HTTP: the
API's requests, the Celery tasks they enqueue (under the call that caused them), SQLAlchemy,
Redis and httpx calls (docs/operations.md); the rest is the SDK's standard environment.
Without the endpoint nothing is imported; with it but without the extra, one warning says what
to install and the process runs untraced. Whatever headers the operator asks the spans to
capture (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*``), credentials are kept out of them
(:func:`sanitize_credentials`)."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
REQUEST_ID_ATTRIBUTE = "batchd.request_id"
SANITIZE_VARIABLE = "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS"
#: Header names (the instrumentations' regular expressions, matched anywhere in a name, any
#: case) whose values a span never holds: the keys batchd takes and sends, and cookies.
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key", "cookie")

_on = False


def wanted() -> bool:
    """Whether the environment asks for traces."""
    return any(os.environ.get(name) for name in ENDPOINT_VARIABLES)


def is_on() -> bool:
    return _on


def sanitize_credentials(environ: MutableMapping[str, str] = os.environ) -> str:
    """Make the instrumentations redact :data:`CREDENTIAL_HEADERS` in any header they capture:
    add them to ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS``, keeping the
    operator's entries. The instrumentations read it when they instrument, so this runs first.
    Returns the value set."""
    given = [f.strip() for f in environ.get(SANITIZE_VARIABLE, "").split(",") if f.strip()]
    have = {f.lower() for f in given}
    fields = given + [h for h in CREDENTIAL_HEADERS if h not in have]
    environ[SANITIZE_VARIABLE] = ",".join(fields)
    return environ[SANITIZE_VARIABLE]


def setup(role: str) -> bool:
    """Start exporting this process's spans (``role``: ``api``, ``control``, ``model`` …) when
    the environment asks for it; once per process. Call it before the first database engine,
    Redis client or httpx client is made. Returns whether traces are on."""
    global _on
    if _on or not wanted():
        return _on
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
        from opentelemetry.instrumentation.redis import RedisInstrumentor
        from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logger.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed (%s): "
            "pip install 'batchd[otel]'; running without traces",
            exc.name,
        )
        return False
    from core.version import version

    sanitize_credentials()
    name = os.environ.get("OTEL_SERVICE_NAME") or f"batchd-{role}"
    resource = Resource.create({"service.name": name, "service.version": version()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    # The instrumentation names SQLAlchemy < 2.1 as its range; its engine events are the same in
    # the 2.1 this project runs, so the check is skipped rather than losing the statements.
    SQLAlchemyInstrumentor().instrument(skip_dep_check=True)
    RedisInstrumentor().instrument()
    HTTPXClientInstrumentor().instrument()
    CeleryInstrumentor().instrument()
    _on = True
    logger.info("exporting traces as %s", name)
    return True


def instrument_app(app: Any) -> None:
    """Trace a FastAPI app's requests (when traces are on)."""
    if _on:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="livez,readyz,healthz,metrics")


def tag_request_id(request_id: str) -> None:
    """Put the API call's id on the span being recorded (when traces are on)."""
    if _on:
        from opentelemetry import trace

        trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, request_id)


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered (a stopping process)."""
    if _on:
        from opentelemetry import trace

        provider: Any = trace.get_tracer_provider()
        force = getattr(provider, "force_flush", None)
        if force is not None:
            force(int(timeout_s * 1000))
