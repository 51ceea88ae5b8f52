"""Probes: ``/livez`` (the process answers; no I/O, for a liveness probe), ``/readyz`` (the
database, broker and storage are reachable, for a readiness probe), and ``/healthz`` (the
database answers, for compose healthchecks)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.deps import SessionDep, SettingsDep, get_storage
from api.routes.envelopes import error_responses
from api.schemas import Health
from core.broker import readiness

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Health,
    responses=error_responses(authenticated=False),
    summary="Health check",
)
def healthz(session: SessionDep) -> Health:
    session.execute(text("SELECT 1"))
    return Health()


@router.get("/livez", response_model=Health, summary="Liveness probe (no I/O)")
async def livez() -> Health:
    return Health()


@router.get(
    "/readyz",
    responses={503: {"description": "A dependency is unreachable; the body names it"}},
    summary="Readiness probe: database, broker and storage reachable",
)
async def readyz(request: Request, settings: SettingsDep) -> JSONResponse:
    failed = await run_in_threadpool(
        readiness.failures,
        {
            "database": lambda: readiness.database(settings.database_url),
            "broker": lambda: readiness.broker(settings.broker_url),
            "storage": lambda: readiness.storage(lambda: get_storage(request, settings)),
        },
    )
    checks = {name: failed.get(name, "ok") for name in ("database", "broker", "storage")}
    status = "unavailable" if failed else "ok"
    return JSONResponse({"status": status, "checks": checks}, status_code=503 if failed else 200)
