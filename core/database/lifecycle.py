"""The state machines of batches, shards and webhook deliveries, and the batch transitions.

validating -> in_progress -> finalizing -> completed; validating -> failed;
validating | in_progress -> cancelling -> cancelled; those three -> expired (expiry sweep).
A validating or in-progress batch may be paused and resumed (``paused_at``, :func:`pause`):
its status stays what it was.

Each batch transition is one conditional UPDATE, so two actors never both win. A transition
into a terminal status of a batch with a ``webhook_url`` inserts its ``webhook_deliveries`` row
in the same transaction (the outbox: docs/core.md)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from core.database.sessions import updated
from core.database.tables import Batch, WebhookDelivery


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ShardStatus(StrEnum):
    """``stopped``: it quit because its batch was cancelled or expired; ``closed``: a
    cancel/expiry finalize sealed it (no more chunks may be committed)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"
    CLOSED = "closed"


class DeliveryStatus(StrEnum):
    """A webhook delivery: pending until it is delivered or its attempts run out."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


TERMINAL = frozenset(
    {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
# Every status but the terminal ones: the batch may still change.
UNFINISHED = tuple(s for s in BatchStatus if s not in TERMINAL)
# The statuses a client may cancel from.
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
# The statuses a client may pause from (a paused batch keeps its status, see pause()).
PAUSABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
# Statuses whose batches hold their prompt tokens against the tenant's enqueued-token limit
# (a batch still validating has not been counted yet, except the one being validated).
ENQUEUED = (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)

ALLOWED: dict[str, frozenset[str]] = {
    BatchStatus.VALIDATING: frozenset(
        {
            BatchStatus.IN_PROGRESS,
            BatchStatus.FAILED,
            BatchStatus.CANCELLING,
            BatchStatus.EXPIRED,
        }
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {
            BatchStatus.FINALIZING,
            BatchStatus.CANCELLING,
            BatchStatus.EXPIRED,
            BatchStatus.FAILED,
        }
    ),
    BatchStatus.FINALIZING: frozenset(
        {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED}
    ),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
}
# The timestamp column stamped when a batch enters each status.
STAMP: dict[str, str] = {
    status: f"{status}_at" for status in BatchStatus if status != BatchStatus.VALIDATING
}


def now() -> datetime:
    """The current time, timezone-aware in UTC: the one clock of the service."""
    return datetime.now(UTC)


# The webhook event type of each terminal status.
EVENT_TYPES: dict[str, str] = {status: f"batch.{status}" for status in TERMINAL}


def webhook_event_id() -> str:
    """A new webhook event id (the delivery row's id and the ``webhook-id`` header)."""
    return "evt_" + secrets.token_hex(12)


# The events of a batch that pauses or resumes (it does not end).
PAUSED_EVENT = "batch.paused"
RESUMED_EVENT = "batch.resumed"


def record_webhook_event(session: Session, batch_id: str, status: str, url: str) -> str:
    """Insert the pending ``webhook_deliveries`` row of ``batch_id`` having ended in
    ``status`` (in the caller's transaction); return its id, the event id."""
    return record_event(session, batch_id, EVENT_TYPES[status], url)


def record_event(session: Session, batch_id: str, event_type: str, url: str) -> str:
    """Insert a pending ``webhook_deliveries`` row of the event ``event_type`` of
    ``batch_id`` (in the caller's transaction); return its id, the event id."""
    delivery_id = webhook_event_id()
    # Whole seconds: the event's created_at is unix seconds, the same on every attempt.
    created = now().replace(microsecond=0)
    session.execute(
        insert(WebhookDelivery).values(
            id=delivery_id,
            batch_id=batch_id,
            event_type=event_type,
            url=url,
            status=DeliveryStatus.PENDING,
            attempts=0,
            created_at=created,
            next_attempt_at=created,
        )
    )
    return delivery_id


def transition(
    session: Session,
    batch_id: str,
    expected: str | Iterable[str],
    target: str,
    **values: Any,
) -> bool:
    """Move ``batch_id`` from one of ``expected`` to ``target``; True if this caller won.

    ``values`` are extra columns set in the same UPDATE. The caller commits. A won transition
    into a terminal status of a batch with a ``webhook_url`` also records the webhook event
    (the outbox row, see the module docstring): the UPDATE returns the URL, so a batch without
    one costs no extra statement, and the event commits or rolls back with the transition.
    """
    sources = {expected} if isinstance(expected, str) else set(expected)
    for source in sources:
        if target not in ALLOWED.get(source, ()):
            raise ValueError(f"illegal batch transition {source} -> {target}")
    values.setdefault(STAMP[target], now())
    statement = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(sources))
        .values(status=target, **values)
        .execution_options(synchronize_session=False)
    )
    if target not in TERMINAL:
        return updated(session, statement) == 1
    won = session.execute(statement.returning(Batch.webhook_url)).first()
    if won is None:
        return False
    if won.webhook_url:
        record_webhook_event(session, batch_id, target, won.webhook_url)
    return True


def pause(session: Session, batch_id: str) -> tuple[bool, str | None]:
    """Mark ``batch_id`` paused if it is validating or in progress and not paused yet:
    ``(won, webhook_url)``. Its status does not change: a paused batch is one whose
    ``paused_at`` is set. The caller commits."""
    won = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(PAUSABLE), Batch.paused_at.is_(None))
        .values(paused_at=now())
        .returning(Batch.webhook_url)
        .execution_options(synchronize_session=False)
    ).first()
    return (False, None) if won is None else (True, won.webhook_url)


def resume(session: Session, batch_id: str, paused_at: datetime) -> tuple[bool, str | None]:
    """Clear the pause that began at ``paused_at``, adding its length to ``paused_s``:
    ``(won, webhook_url)``; False if another resume came first. The caller commits."""
    paused_for = max(0.0, (now() - paused_at).total_seconds())
    won = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.paused_at == paused_at)
        .values(paused_at=None, paused_s=Batch.paused_s + paused_for)
        .returning(Batch.webhook_url)
        .execution_options(synchronize_session=False)
    ).first()
    return (False, None) if won is None else (True, won.webhook_url)
