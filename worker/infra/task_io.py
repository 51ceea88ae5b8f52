"""Helpers shared by the control and shard tasks: storage, sending tasks, shard liveness,
retrying database and broker calls through short outages."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, TypeVar

from jinja2 import TemplateError
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.broker.queue import CONTROL_QUEUE
from core.database.lifecycle import ShardStatus, now
from core.database.tables import Batch, File, Shard
from core.settings import get_settings
from core.storage import open_storage
from core.storage.base import Storage
from worker.infra.celery import app

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a worker keeps retrying a database or broker call before giving up on it.
OUTAGE_PATIENCE_S = 120.0


@lru_cache
def _storage(url: str, endpoint: str | None) -> Storage:
    return open_storage(url, s3_endpoint_url=endpoint)


def storage() -> Storage:
    settings = get_settings()
    return _storage(settings.storage_url, settings.s3_endpoint_url)


def input_key(session: Session, batch: Batch) -> str:
    file = session.get(File, batch.input_file_id)
    if file is None:
        raise LookupError(f"input file {batch.input_file_id} of {batch.id} is gone")
    return file.storage_key


# What a request's own content may raise while it is templated and tokenized (a chat template
# that refuses its messages, a prompt the tokenizer or the sampling parameters reject): the
# request fails on its own, with an error line. Anything else is a bug and is raised.
REQUEST_ERRORS: tuple[type[Exception], ...] = (ValueError, TemplateError)


def transient_error(exc: BaseException) -> bool:
    """A lost or refused connection to the database or the broker: worth retrying."""
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(
        exc, KombuOperationalError | RedisConnectionError | RedisTimeoutError | ConnectionError
    )


def retrying(
    fn: Callable[[], T],
    what: str,
    *,
    patience_s: float | None = None,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient database/broker errors with
    exponential backoff (with jitter) for up to ``patience_s`` seconds; other errors, and the
    last transient one, propagate. ``fn`` must be safe to call again after a failure (each
    call opens its own transaction, so a failed one rolled back or is detected as done)."""
    deadline = time.monotonic() + (OUTAGE_PATIENCE_S if patience_s is None else patience_s)
    delay = first_delay_s
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not transient_error(exc) or time.monotonic() + delay > deadline:
                raise
            attempt += 1
            logger.warning(
                "%s failed (%s: %s); retry %d in %.1fs",
                what,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                attempt,
                delay,
            )
            time.sleep(delay * (0.75 + random.random() / 2))
            delay = min(max_delay_s, delay * 2)


def send(task: str, *args: Any, queue: str = CONTROL_QUEUE, countdown: float | None = None) -> None:
    """Enqueue ``task`` (to run ``countdown`` seconds from now, if given); call only after the
    rows it reads are committed. Retries through a broker outage (a task that must not be lost,
    like a finalize, is sent once it is back)."""
    retrying(
        lambda: app.send_task(task, args=list(args), queue=queue, countdown=countdown),
        f"sending {task}",
    )


def past_expiry(expires_at: datetime | None) -> bool:
    return expires_at is not None and now() >= expires_at


def heartbeat_interval_s() -> float:
    return max(0.05, float(get_settings().heartbeat_interval_s))


def stale_after_s() -> float:
    """A running shard whose heartbeat is older than this is presumed dead (its worker was
    killed, lost its node, or hangs); the reclaim sweep re-queues it. Never less than three
    heartbeats, so one slow database round trip does not look like a death."""
    settings = get_settings()
    return max(float(settings.shard_stale_after_s), 3 * heartbeat_interval_s())


def live_shards(session: Session, batch_id: str) -> int:
    """Shards of ``batch_id`` that a live worker is running now."""
    cutoff = now() - timedelta(seconds=stale_after_s())
    return (
        session.scalar(
            select(func.count())
            .select_from(Shard)
            .where(
                Shard.batch_id == batch_id,
                Shard.status == ShardStatus.RUNNING,
                Shard.heartbeat_at >= cutoff,
            )
        )
        or 0
    )


def unfinished_shards(session: Session, batch_id: str) -> int:
    return (
        session.scalar(
            select(func.count())
            .select_from(Shard)
            .where(Shard.batch_id == batch_id, Shard.status != ShardStatus.DONE)
        )
        or 0
    )
