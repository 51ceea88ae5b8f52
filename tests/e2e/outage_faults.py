"""Pauses for the outage tests (tests/e2e/test_outages.py), loaded only by them into a real
control worker: ``celery worker -I outage_faults`` with this folder on ``PYTHONPATH``. Nothing
in the service refers to this module.

While the file ``$BATCHD_TEST_PAUSE_DIR/<step>`` exists (``validate`` or ``finalize``), the
first run of that step for each batch pauses once it has started (its task message delivered
and not yet acknowledged: the worker runs ``task_acks_late``): it creates ``<step>-<batch
id>.started`` in that folder and waits for ``<step>-<batch id>.go`` (at most two minutes), so
that a test can cut the database or the broker at exactly that point and let the step go on
during the outage.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import worker.batches.tasks as tasks

logger = logging.getLogger("outage_faults")
_lock = threading.Lock()
_paused: set[tuple[str, str]] = set()
_real = {"validate": tasks.validate, "finalize": tasks.finalize}
WAIT_S = 120.0


def _pause(step: str, batch_id: str) -> None:
    folder = Path(os.environ["BATCHD_TEST_PAUSE_DIR"])
    if not (folder / step).exists():
        return
    with _lock:
        if (step, batch_id) in _paused:
            return
        _paused.add((step, batch_id))
    (folder / f"{step}-{batch_id}.started").touch()
    logger.warning("paused: %s of %s", step, batch_id)
    deadline = time.monotonic() + WAIT_S
    while not (folder / f"{step}-{batch_id}.go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    logger.warning("resumed: %s of %s", step, batch_id)


def validate(batch_id: str) -> str | None:
    _pause("validate", batch_id)
    return _real["validate"](batch_id)


def finalize(batch_id: str) -> str | None:
    _pause("finalize", batch_id)
    return _real["finalize"](batch_id)


tasks.validate = validate
tasks.finalize = finalize
