"""batchd's extensions beside the OpenAI batch routes: a batch's results while it runs
(``GET /v1/batches/{id}/results``, shown once its validation is done) and a retry of what did
not succeed (``POST /v1/batches/{id}/retry``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel

from api.deps import CurrentKey, SessionDep, SettingsDep, StorageDep
from api.errors import invalid_request
from api.retries import RetryCreate, retry_batch
from api.routes.batches import get_batch_row
from api.routes.common import could_be_id, error_responses
from api.schemas import BatchPublic
from core.lifecycle import BatchStatus
from core.results_log import DEFAULT_PAGE, MAX_PAGE, cursor_seq, read_page

router = APIRouter(prefix="/batches", tags=["batches"])


def results_visible(status: str, validation_done: bool) -> bool:
    """A batch's results are shown once its validation is done (before that a whole-file rule
    may still fail it, and a batch that fails never shows any), or once it ended cancelled or
    expired (its files then hold them)."""
    return validation_done or status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED)


class ResultPage(BaseModel):
    """Result lines in the order they were committed, each exactly as it appears (or will) in
    the batch's output or error file."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


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
    batch = get_batch_row(session, caller.tenant, batch_id)
    if not results_visible(batch.status, batch.validation_done):
        return ResultPage(data=[], first_id=None, last_id=None, has_more=False)
    start = 0
    if after is not None:
        seq = cursor_seq(session, batch.id, after) if could_be_id(after) else None
        if seq is None:
            raise invalid_request(
                f"Invalid value for 'after': {after!r} is not the id of a result line of batch "
                f"{batch_id} (pass the 'last_id' of the previous page).",
                param="after",
            )
        start = seq + 1
    page = read_page(session, storage, batch.id, start=start, limit=limit)
    return ResultPage(
        data=page.data,
        first_id=page.data[0].get("id") if page.data else None,
        last_id=page.data[-1].get("id") if page.data else None,
        has_more=page.has_more,
    )


@router.post(
    "/{batch_id}/retry",
    response_model=BatchPublic,
    responses=error_responses(400, 403, 404, 409),
    summary="Retry what did not succeed in a batch (batchd extension)",
)
def retry(
    batch_id: str,
    caller: CurrentKey,
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    body: Annotated[RetryCreate | None, Body()] = None,
) -> BatchPublic:
    return retry_batch(session, storage, caller, settings, batch_id, body or RetryCreate())
