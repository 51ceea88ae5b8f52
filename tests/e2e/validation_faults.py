"""A pause in a real control worker's streamed validation, loaded only by tests:
``celery worker -I validation_faults`` with this folder on ``PYTHONPATH``. Nothing in the
service refers to this module.

When ``$BATCHD_TEST_FAULT_DIR/<input file id>`` holds ``pause:<k>``, the validation of a batch
of that input stops right after it has created (and released) shard ``k``, logs
``injected fault: validation of <batch> paused after shard <k>``, and waits until
``<input file id>.go`` exists in the same folder: the test then acts (kills the worker, cancels
the batch, reads its results) while the batch is ``in_progress`` with its validation not done.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from worker.validation.task import StreamedValidation

logger = logging.getLogger("validation_faults")
_real_create = StreamedValidation._create


def _create(self: StreamedValidation, spec, *, last: bool):  # type: ignore[no-untyped-def]
    outcome = _real_create(self, spec, last=last)
    path = Path(os.environ["BATCHD_TEST_FAULT_DIR"]) / self.key.rsplit("/", 1)[-1]
    try:
        kind, _, index = path.read_text().strip().partition(":")
    except FileNotFoundError:
        return outcome
    if kind == "pause" and outcome is None and spec.index == int(index):
        logger.warning(
            "injected fault: validation of %s paused after shard %s", self.batch_id, spec.index
        )
        go = path.with_name(path.name + ".go")
        while not go.exists():
            time.sleep(0.05)
    return outcome


StreamedValidation._create = _create  # type: ignore[method-assign]
