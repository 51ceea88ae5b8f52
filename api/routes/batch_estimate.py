"""``POST /v1/batches/estimate`` (a batchd extension): a create's outcome, without creating."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentKey, SessionDep, SettingsDep
from api.routes.envelopes import error_responses
from api.schemas import BatchCreate, BatchEstimate
from api.services import estimates

router = APIRouter(prefix="/batches", tags=["batches"])


@router.post(
    "/estimate",
    response_model=BatchEstimate,
    responses=error_responses(400, 403, 404, 500, 503),
    summary="Estimate a batch without creating it (batchd extension)",
)
async def estimate_batch(
    body: BatchCreate, caller: CurrentKey, session: SessionDep, settings: SettingsDep
) -> BatchEstimate:
    return await estimates.estimate_batch(session, settings, caller, body)
