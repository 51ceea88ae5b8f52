"""The Celery application shared by the control worker, the model workers and beat.

Control worker (validate, finalize, cancel, expiry sweep; no model loaded)::

    celery -A worker.celery_app worker -Q batchd.control --pool threads -c 2

Model worker (one per GPU process; loads the engine once, runs several shards at a time so
the engine's batch stays full across shard boundaries; never forks after the model loads)::

    celery -A worker.celery_app worker -Q batchd.model.<name> --pool threads \\
        -c $BATCHD_WORKER_SHARD_CONCURRENCY

Beat (the expiry sweep, every ``BATCHD_EXPIRY_SWEEP_INTERVAL_S`` seconds)::

    celery -A worker.celery_app beat

``python -m worker control|model|beat`` builds these command lines from the settings.

Tasks are idempotent and re-read the database before acting, so late acknowledgement (a task
whose worker dies is delivered again) never runs a step twice in a way anyone can see.
"""

from __future__ import annotations

from celery import Celery

from core.queue import (
    CONTROL_QUEUE,
    TASK_CANCEL,
    TASK_FINALIZE,
    TASK_SWEEP_EXPIRED,
    TASK_VALIDATE,
)
from core.settings import get_settings


def create_app() -> Celery:
    settings = get_settings()
    celery = Celery("batchd", broker=settings.broker_url, include=["worker.tasks", "worker.shard"])
    control = {"queue": CONTROL_QUEUE}
    celery.conf.update(
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        task_default_queue=CONTROL_QUEUE,
        # Shard tasks name their model's queue when they are sent (core.queue.model_queue).
        task_routes={
            TASK_VALIDATE: control,
            TASK_FINALIZE: control,
            TASK_CANCEL: control,
            TASK_SWEEP_EXPIRED: control,
        },
        beat_schedule={
            "sweep-expired": {
                "task": TASK_SWEEP_EXPIRED,
                "schedule": float(settings.expiry_sweep_interval_s),
                "options": {"queue": CONTROL_QUEUE, "expires": settings.expiry_sweep_interval_s},
            }
        },
    )
    return celery


app = create_app()
