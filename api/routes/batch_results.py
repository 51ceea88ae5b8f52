"""batchd's extensions beside the OpenAI batch routes: results so far, and a retry.

``GET /v1/batches/{id}/results`` lists a batch's results while it runs (once its validation is
done); ``POST /v1/batches/{id}/retry`` retries what did not succeed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep
from api.routes.batches import IdempotencyHeader, created_batch, idempotency_key_of
from api.routes.envelopes import error_responses
from api.schemas import BatchPublic, ResultPage, RetryCreate
from api.services.results import result_page
from api.services.retries import retry_batch
from core.database.results_log import DEFAULT_PAGE, MAX_PAGE

router = APIRouter(prefix="/batches", tags=["batches"])


@router.get(
    "/{batch_id}/results",
    response_model=ResultPage,
    responses=error_responses(400, 404),
    summary="List a batch's results committed so far (batchd extension)",
)
def list_results(
    batch_id: str,
    caller: CurrentKey,
    session: SessionDep,
    storage: StorageDep,
    after: Annotated[
        str | None,
        Query(max_length=64, description="The `id` of the last result line already seen."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
) -> ResultPage:
    page = result_page(session, storage, caller.tenant, batch_id, after, limit)
    return ResultPage(
        data=page.data,
        first_id=page.data[0].get("id") if page.data else None,
        last_id=page.data[-1].get("id") if page.data else None,
        has_more=page.has_more,
    )


@router.post(
    "/{batch_id}/retry",
    response_model=BatchPublic,
    responses=error_responses(400, 403, 404, 409, 429),
    summary="Retry what did not succeed in a batch (batchd extension)",
)
def retry(
    batch_id: str,
    caller: CurrentKey,
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    body: Annotated[RetryCreate | None, Body()] = None,
    idempotency_key: IdempotencyHeader = None,
) -> BatchPublic:
    key = idempotency_key_of(idempotency_key, None)
    row = retry_batch(session, storage, caller, settings, batch_id, body or RetryCreate(), key)
    return created_batch(row, caller)
