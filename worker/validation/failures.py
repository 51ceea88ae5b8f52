"""How validation fails a batch: its error report, the enqueued-token limit, a late failure.

``errors.data`` of a file with errors, the tenant's enqueued-token limit (locked per tenant and
model while a shard is counted against it), and failing a batch whose validation is not done
while its first shards may already run (``docs/validation.md``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from core.batchfile.reader import ValidationReport
from core.database import results_log
from core.database.lifecycle import ENQUEUED, BatchStatus, ShardStatus, transition
from core.database.results_log import batch_log_prefix
from core.database.sessions import new_session
from core.database.tables import Batch, Shard
from worker.events import notify
from worker.infra import storage
from worker.shards.release import release_for_model

logger = logging.getLogger(__name__)


def lock_tenant_model(session: Session, tenant: str, model: str) -> None:
    """Serialize quota checks of one tenant and model until this transaction ends, so two
    batches validated at once cannot both fit into the room for one (Postgres only; SQLite
    writers are serialized by the database)."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.sha256(f"batchd.quota:{tenant}:{model}".encode()).digest()
    session.execute(
        text("SELECT pg_advisory_xact_lock(:key)"),
        {"key": int.from_bytes(digest[:8], "big", signed=True)},
    )


def enqueued_tokens(session: Session, tenant: str, model: str, exclude: str | None = None) -> int:
    """Prompt tokens of ``tenant``'s unfinished batches on ``model``."""
    query = select(func.coalesce(func.sum(Batch.est_prompt_tokens), 0)).where(
        Batch.tenant == tenant, Batch.model == model, Batch.status.in_(ENQUEUED)
    )
    if exclude is not None:
        query = query.where(Batch.id != exclude)
    return int(session.scalar(query) or 0)


def quota_error(
    tenant: str, model: str, limit: int, used: int, tokens: int, line: int | None = None
) -> dict[str, Any]:
    """The ``errors`` entry of a batch over its tenant's enqueued-token limit; ``line`` is the
    line that took it over when that was found after the head."""
    through = f" through line {line}" if line is not None else ""
    return {
        "code": "token_limit_exceeded",
        "message": f"Enqueued token limit reached for {model} in tenant {tenant}: "
        f"limit {limit:,}, already enqueued {used:,}, this batch {tokens:,}{through}. "
        "Please try again once some of your batches have completed.",
        "param": None,
        "line": line,
    }


def budget_error(budget: int, tokens: int, line: int) -> dict[str, Any]:
    """The ``errors`` entry of a batch whose prompts alone (counted through ``line``) exceed
    its token budget: its outputs could never fit."""
    return {
        "code": "token_budget_exceeded",
        "message": f"The batch's prompts alone come to at least {tokens:,} tokens (counted "
        f"through line {line}), more than its token budget max_total_tokens={budget:,}: no "
        "output could fit. Raise max_total_tokens or split the file.",
        "param": "max_total_tokens",
        "line": None,
    }


def too_many_errors(report: ValidationReport) -> dict[str, Any]:
    return {
        "code": "too_many_errors",
        "message": f"{report.num_more_errors} more errors were not reported "
        f"(the first {len(report.errors)} are listed)",
        "param": None,
        "line": None,
    }


def validation_errors(report: ValidationReport) -> list[dict[str, Any]]:
    """The ``errors.data`` of a batch whose file has errors: the first ones, then how many
    more were left out."""
    errors = report.error_dicts()
    if report.num_more_errors:
        errors.append(too_many_errors(report))
    return errors


def fail_running(batch_id: str, error: dict[str, Any]) -> bool:
    """Fail a batch whose validation is not done (in ``validating``, or ``in_progress`` with
    shards running): seal its unfinished shards, fail it with ``error``, drop its results log
    (nothing of it is ever shown), then delete the log's chunks, send its webhook event and let
    the release fill the slots it held. True if this call failed it.

    Shards are sealed before the batch row is locked, the order a checkpoint commit takes
    them in (``worker.shards.state.commit_chunk``)."""
    session = new_session()
    try:
        session.execute(
            update(Shard)
            .where(
                Shard.batch_id == batch_id,
                Shard.status.not_in((ShardStatus.DONE, ShardStatus.CLOSED)),
            )
            .values(status=ShardStatus.CLOSED)
            .execution_options(synchronize_session=False)
        )
        row = session.execute(
            select(Batch.status, Batch.validation_done, Batch.model)
            .where(Batch.id == batch_id)
            .with_for_update()
        ).first()
        running = row is not None and (
            row.status == BatchStatus.VALIDATING
            or (row.status == BatchStatus.IN_PROGRESS and not row.validation_done)
        )
        won = running and transition(
            session,
            batch_id,
            (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
            BatchStatus.FAILED,
            errors=[error],
            request_completed=0,
            request_failed=0,
        )
        if row is None or not won:
            session.rollback()
            return False
        model = row.model
        results_log.drop(session, [batch_id])
        session.commit()
    finally:
        session.close()
    try:
        storage().delete_prefix(batch_log_prefix(batch_id))
    except Exception:
        logger.exception("batch %s: results log forgotten, its chunks were not", batch_id)
    notify(batch_id, BatchStatus.FAILED)
    try:
        release_for_model(model)
    except Exception:
        logger.exception("batch %s: could not release the next shards of %s", batch_id, model)
    return True
