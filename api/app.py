"""The FastAPI application: ``create_app(settings)``, and ``app`` for ``uvicorn api.app:app``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from api import errors, log_context, prometheus, ui
from api.gate import RequestGate
from api.limits import auth_enabled
from api.local import check_auth_off_is_local
from api.routes import anthropic, batch_results, batches, files, health, models, uploads
from api.routes.batch_estimate import router as estimate_router
from core.llms import specs
from core.observability import tracing
from core.observability.logs import configure_process
from core.settings import Settings, get_settings
from core.version import version

API_PREFIX = "/v1"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    check_auth_off_is_local(settings, auth_enabled(settings))
    specs.adapters(settings.models)  # a LoRA entry with no base, naming it
    tracing.setup("api")  # before the first database engine or Redis client is made
    app = FastAPI(
        title="batchd",
        version=version(),
        description="Self-hosted, OpenAI-compatible batch inference: the Files, Batches and "
        'Models APIs. Errors use OpenAI\'s envelope `{"error": {message, type, param, code}}`.',
    )
    app.state.settings = settings
    app.state.started_at = int(time.time())
    errors.install(app)
    # Inside the metrics middleware (added next, so outside it): its refusals are counted.
    app.add_middleware(RequestGate, settings=settings, routes=app.routes)
    prometheus.install(app, settings)
    configure_process(settings.log_format, UVICORN_LOGGERS)
    app.include_router(health.router)
    routers = (files.router, batches.router, batch_results.router, models.router)
    for router in (*routers, uploads.router):
        app.include_router(router, prefix=API_PREFIX)
    # Not in the OpenAPI document, which describes the OpenAI-shaped API and its error
    # envelope: these routes follow Anthropic's published API instead.
    app.include_router(anthropic.router, prefix=API_PREFIX, include_in_schema=False)
    app.include_router(estimate_router, prefix=API_PREFIX)
    ui.install(app)
    log_context.install(app)
    tracing.instrument_app(app)  # after: its span is current while the log context is bound
    _document_validation_as_400(app)
    return app


def _document_validation_as_400(app: FastAPI) -> None:
    """Request validation errors are answered as 400 in the error envelope, never FastAPI's 422;
    the OpenAPI document says so, so that schema-driven clients and fuzzers agree with us."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                if not isinstance(operation, dict) or "responses" not in operation:
                    continue
                responses = operation["responses"]
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": "Invalid request",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                            }
                        },
                    }
        components = schema.get("components", {}).get("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        _document_bearer_auth(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_bearer_auth(schema: dict[str, Any]) -> None:
    """Every operation but the health check takes ``Authorization: Bearer <key>``."""
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "An API key, sk-bd-…"}
    }
    schema["security"] = [{"bearer": []}]
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict) and "401" not in operation.get("responses", {}):
                operation["security"] = []


app = create_app()
