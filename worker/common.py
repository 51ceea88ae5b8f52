"""Helpers shared by the control and shard tasks: storage, sending tasks, shard liveness."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.models import Batch, Shard
from core.queue import CONTROL_QUEUE
from core.settings import get_settings
from core.storage import Storage, open_storage

# Shard statuses. ``stopped``: it quit because its batch was cancelled or expired;
# ``closed``: a cancel/expiry finalize sealed it (no more chunks may be committed).
PENDING, RUNNING, DONE, STOPPED, CLOSED = "pending", "running", "done", "stopped", "closed"

HEARTBEAT_INTERVAL_S = 10.0


@lru_cache
def _storage(url: str, endpoint: str | None) -> Storage:
    return open_storage(url, s3_endpoint_url=endpoint)


def storage() -> Storage:
    settings = get_settings()
    return _storage(settings.storage_url, settings.s3_endpoint_url)


def input_key(session: Session, batch: Batch) -> str:
    from core.models import File

    file = session.get(File, batch.input_file_id)
    if file is None:
        raise LookupError(f"input file {batch.input_file_id} of {batch.id} is gone")
    return file.storage_key


def send(task: str, *args: Any, queue: str = CONTROL_QUEUE) -> None:
    """Enqueue ``task``; call only after the rows it reads are committed."""
    from worker.celery_app import app

    app.send_task(task, args=list(args), queue=queue)


def utcnow() -> datetime:
    return datetime.now(UTC)


def past_expiry(expires_at: datetime | None, now: datetime | None = None) -> bool:
    if expires_at is None:
        return False
    if expires_at.tzinfo is None:  # SQLite hands back naive datetimes
        expires_at = expires_at.replace(tzinfo=UTC)
    return (now or utcnow()) >= expires_at


def stale_after_s() -> float:
    """A running shard whose heartbeat is older than this is presumed dead."""
    return max(60.0, 6 * HEARTBEAT_INTERVAL_S, 6 * get_settings().checkpoint_interval_s)


def live_shards(session: Session, batch_id: str) -> int:
    """Shards of ``batch_id`` that a live worker is running now."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s())
    return (
        session.scalar(
            select(func.count())
            .select_from(Shard)
            .where(
                Shard.batch_id == batch_id, Shard.status == RUNNING, Shard.heartbeat_at >= cutoff
            )
        )
        or 0
    )


def unfinished_shards(session: Session, batch_id: str) -> int:
    return (
        session.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.batch_id == batch_id, Shard.status != DONE)
        )
        or 0
    )
