"""Celery infrastructure of the workers: the app, the engines of the process, shared helpers.

The other rooms import what they need from here, and it imports none of them at module level
(``tests/test_structure.py``). Importing it loads no engine and no torch: ``runtime`` imports
the engine only when a model is loaded, and an upstream's dispatcher only when it starts one.
"""

from worker.infra import runtime
from worker.infra.celery import app
from worker.infra.task_io import (
    REQUEST_ERRORS,
    heartbeat_interval_s,
    input_key,
    live_shards,
    past_expiry,
    retrying,
    send,
    stale_after_s,
    storage,
    transient_error,
    unfinished_shards,
)

__all__ = [
    "REQUEST_ERRORS",
    "app",
    "heartbeat_interval_s",
    "input_key",
    "live_shards",
    "past_expiry",
    "retrying",
    "runtime",
    "send",
    "stale_after_s",
    "storage",
    "transient_error",
    "unfinished_shards",
]
