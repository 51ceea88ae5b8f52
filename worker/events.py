"""A batch's webhook event, sent when the batch ends: :func:`notify` enqueues the delivery of
the event its terminal transition recorded. The delivery itself (attempts, retries, the sweep of
what was never sent) is :mod:`worker.batches.webhooks`, which this names only by its task.

A room of its own below validation and batches: both end batches, and each sends the event.
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from core.broker.queue import TASK_DELIVER_WEBHOOK, WEBHOOK_QUEUE
from core.database.lifecycle import EVENT_TYPES, DeliveryStatus, record_webhook_event
from core.database.sessions import session_scope
from core.database.tables import Batch, WebhookDelivery
from worker.infra import send

logger = logging.getLogger(__name__)


def notify(batch_id: str, status: str) -> str | None:
    """Enqueue the delivery of the event of ``batch_id`` having ended in ``status``; call after
    the terminal transition commits (which recorded the event in the outbox, see
    :mod:`worker.batches.webhooks`). Returns the delivery id, or None when there is nothing to
    send. A batch ended without :func:`core.database.lifecycle.transition` (a tool, a test) has its
    event recorded here first.
    Never raises: a webhook problem must not undo or fail the transition, and the sweep
    enqueues what this could not."""
    event_type = EVENT_TYPES.get(status)
    if event_type is None:
        return None
    try:
        with session_scope() as session:
            # A batch ends once: its one event, whatever the status named here.
            delivery = session.execute(
                select(
                    WebhookDelivery.id,
                    WebhookDelivery.event_type,
                    WebhookDelivery.status,
                    WebhookDelivery.attempts,
                )
                .where(
                    WebhookDelivery.batch_id == batch_id,
                    # Its pause and resume events are not the one it ends with.
                    WebhookDelivery.event_type.in_(EVENT_TYPES.values()),
                )
                .limit(1)
            ).first()
            if delivery is not None:
                if (
                    delivery.event_type != event_type
                    or delivery.status != DeliveryStatus.PENDING
                    or delivery.attempts
                ):
                    return None  # another event, or already under way (a repeated call)
                delivery_id = delivery.id
            else:
                url = session.scalar(select(Batch.webhook_url).where(Batch.id == batch_id))
                if not url:
                    return None
                delivery_id = record_webhook_event(session, batch_id, status, url)
    except Exception:
        logger.exception("batch %s: could not read its %s webhook event", batch_id, status)
        return None
    try:
        send(TASK_DELIVER_WEBHOOK, delivery_id, queue=WEBHOOK_QUEUE)
    except Exception:
        logger.exception(
            "batch %s: could not enqueue webhook %s (the webhook sweep sends it)",
            batch_id,
            delivery_id,
        )
        return delivery_id
    logger.info("batch %s: %s webhook %s enqueued", batch_id, event_type, delivery_id)
    return delivery_id
