"""Faults for a real control worker, loaded only by tests: ``celery worker -I control_faults``
with this folder on ``PYTHONPATH``. Nothing in the service refers to this module.

A batch gets a fault when the file ``$BATCHD_TEST_FAULT_DIR/<batch id>`` exists; its text
names it: ``validate:once`` (the first validate of the batch raises), ``validate:always`` or
``finalize:always``; or ``notify:exit``: the worker process exits (``os._exit``, no cleanup)
right after the batch's terminal transition committed, before the webhook delivery is
enqueued (the webhook outbox test). Each injected failure logs ``injected fault``.

The first validate this process runs also logs which of transformers' Auto classes were
already imported (``auto classes before the first validate: [...]``): in a control worker
nothing else imports them, so this shows what the worker's start imported.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter
from pathlib import Path

import worker.batches.finalize as finalize_module
import worker.batches.tasks as tasks
import worker.validation.failures as failures_module
import worker.validation.task as validation_module
from worker.infra.celery import TRANSFORMERS_NAMES

logger = logging.getLogger("control_faults")
_lock = threading.Lock()
_calls: Counter[tuple[str, str]] = Counter()
_first_validate = True
_real = {"validate": tasks.validate, "finalize": tasks.finalize, "notify": tasks.notify}
EXIT_CODE = 70


def _fault(step: str, batch_id: str) -> None:
    path = Path(os.environ["BATCHD_TEST_FAULT_DIR"]) / batch_id
    try:
        kind, _, mode = path.read_text().strip().partition(":")
    except FileNotFoundError:
        return
    if kind != step:
        return
    with _lock:
        _calls[step, batch_id] += 1
        call = _calls[step, batch_id]
    if mode == "exit":
        logger.warning("injected fault: the process exits at %s of %s", step, batch_id)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_CODE)
    if mode == "always" or (mode == "once" and call == 1):
        logger.warning("injected fault: %s of %s, call %s", step, batch_id, call)
        raise RuntimeError(f"injected {step} fault (call {call})")


def validate(batch_id: str) -> str | None:
    global _first_validate
    with _lock:
        first, _first_validate = _first_validate, False
    if first:
        transformers = sys.modules.get("transformers")
        ready = [n for n in TRANSFORMERS_NAMES if transformers and n in vars(transformers)]
        logger.warning("auto classes before the first validate: %s", ready)
    _fault("validate", batch_id)
    return _real["validate"](batch_id)


def finalize(batch_id: str) -> str | None:
    _fault("finalize", batch_id)
    return _real["finalize"](batch_id)


def notify(batch_id: str, status: str) -> str | None:
    _fault("notify", batch_id)
    return _real["notify"](batch_id, status)


tasks.validate = validate
tasks.finalize = finalize
# Every call site of the webhook notify (after a validate that failed the batch, and after a
# finalize's commit).
tasks.notify = notify
validation_module.notify = notify
failures_module.notify = notify
finalize_module.notify = notify
