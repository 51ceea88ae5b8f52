"""A batch's results while it runs: which batches show them, and a page of committed lines."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.errors import invalid_request
from api.services.batches import get_batch_row
from api.services.lookups import could_be_id
from core.database.lifecycle import BatchStatus
from core.database.results_log import Page, cursor_seq, read_page
from core.storage.base import Storage


def results_visible(status: str, validation_done: bool) -> bool:
    """A batch's results are shown once its validation is done (before that a whole-file rule
    may still fail it, and a batch that fails never shows any), or once it ended cancelled or
    expired (its files then hold them)."""
    return validation_done or status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED)


def result_page(
    session: Session, storage: Storage, tenant: str, batch_id: str, after: str | None, limit: int
) -> Page:
    """Up to ``limit`` result lines of the tenant's batch after the line ``after`` (None: from
    the first); none while the batch does not show results. An ``after`` that is not a line
    the batch shows is refused whether or not it shows any yet, so the answer to a bad cursor
    does not depend on how far the batch got."""
    batch = get_batch_row(session, tenant, batch_id)
    visible = results_visible(batch.status, batch.validation_done)
    start = 0
    if after is not None:
        known = visible and could_be_id(after)
        seq = cursor_seq(session, batch.id, after) if known else None
        if seq is None:
            raise invalid_request(
                f"Invalid value for 'after': {after!r} is not the id of a result line of batch "
                f"{batch_id} (pass the 'last_id' of the previous page).",
                param="after",
            )
        start = seq + 1
    if not visible:
        return Page(data=[], has_more=False)
    return read_page(session, storage, batch.id, start=start, limit=limit)
