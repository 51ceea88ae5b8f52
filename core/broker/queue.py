"""The wire contract between the API, the control worker and the model workers: task names,
queue names, and a producer that enqueues by name (so the API never imports the worker)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# Every process that enqueues or runs tasks imports this module; with it come the task
# signals that carry an API call's x-request-id into the log lines of the tasks it caused.
from core.observability import request_ids

TASK_VALIDATE = "batchd.validate_batch"
TASK_RUN_SHARD = "batchd.run_shard"
TASK_FINALIZE = "batchd.finalize_batch"
TASK_CANCEL = "batchd.cancel_batch"
TASK_SWEEP_EXPIRED = "batchd.sweep_expired"
TASK_RECLAIM = "batchd.reclaim_stale_shards"
TASK_RELEASE_SWEEP = "batchd.release_shards"
TASK_DELIVER_WEBHOOK = "batchd.deliver_webhook"
TASK_SWEEP_FILES = "batchd.sweep_files"
TASK_SWEEP_UPLOADS = "batchd.sweep_uploads"
TASK_SWEEP_WEBHOOKS = "batchd.sweep_webhooks"
TASK_ESTIMATE = "batchd.estimate_batch"
TASK_REFRESH_ETAS = "batchd.refresh_etas"

CONTROL_QUEUE = "batchd.control"
# Webhook deliveries: consumed by every worker that consumes the control queue, and run on that
# process's own webhook threads, never on the control pool's (worker.batches.webhooks).
WEBHOOK_QUEUE = "batchd.webhooks"

# Every Redis socket is bounded, so that a broker that vanishes without closing its
# connections (a lost host, a dropped route) costs a reconnect or a failed publish instead of
# a thread blocked in a read or a connect for the kernel's TCP timeouts. A producer (the API's
# enqueue, a reply to the API) waits at most PRODUCER_SOCKET_TIMEOUT_S for one answer; the
# workers' consumers allow more (worker.infra.celery).
SOCKET_CONNECT_TIMEOUT_S = 5.0
PRODUCER_SOCKET_TIMEOUT_S = 5.0


def redis_socket_options(broker_url: str, socket_timeout: float) -> dict[str, Any]:
    """The transport options that bound a Redis broker's sockets (none for other brokers)."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return {}
    return {
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
    }


def model_queue(model: str) -> str:
    """The queue that the workers serving ``model`` consume."""
    return "batchd.model." + re.sub(r"[^A-Za-z0-9_.-]", "_", model)


@lru_cache
def _producer(broker_url: str):
    from celery import Celery

    app = Celery("batchd-producer", broker=broker_url)
    app.conf.broker_connection_retry_on_startup = True
    app.conf.broker_transport_options = redis_socket_options(broker_url, PRODUCER_SOCKET_TIMEOUT_S)
    return app


def enqueue(
    task: str,
    *args: Any,
    queue: str = CONTROL_QUEUE,
    countdown: float | None = None,
    broker_url: str | None = None,
) -> None:
    """Send ``task`` by name. Call only after the rows it reads are committed."""
    if broker_url is None:
        from core.settings import get_settings

        broker_url = get_settings().broker_url
    _producer(broker_url).send_task(
        task, args=list(args), queue=queue, countdown=countdown, headers=request_ids.headers()
    )


def engine_stats(broker_url: str, timeout: float = 1.0) -> list[dict[str, Any]]:
    """Every model worker's engine figures (the workers' ``engine_stats`` remote control
    command, see worker/infra/runtime.py): one ``{worker name: {"models": {...}, "time": ...}}``
    reply per worker that answered within ``timeout`` seconds."""
    control = _producer(broker_url).control
    return list(control.broadcast("engine_stats", reply=True, timeout=timeout) or [])
