"""``/healthz``: the process is up and the database answers (for compose healthchecks)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from api.deps import SessionDep
from api.routes.common import error_responses
from api.schemas import Health

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
