"""The upload sweep: a beat task, every ``upload_sweep_interval_s``, that marks uploads past
their hour ``expired`` and deletes their parts, gives back the uploads whose complete died
holding its claim (``upload_complete_lease_s``), and deletes the parts an ended upload still
has. The rules live in :mod:`core.database.uploads`, which the API's routes share."""

from __future__ import annotations

import logging
from typing import Any

from core.broker.queue import TASK_SWEEP_UPLOADS
from core.database import uploads
from core.database.sessions import session_scope
from core.settings import get_settings
from worker.infra import app, storage

logger = logging.getLogger(__name__)


def sweep_uploads() -> int:
    """One sweep; how many uploads it changed."""
    with session_scope() as session:
        changed = uploads.sweep_all(session, storage(), get_settings().upload_complete_lease_s)
    if changed:
        logger.info("upload sweep: %s uploads expired, given back or cleaned up", changed)
    return changed


@app.task(name=TASK_SWEEP_UPLOADS)
def sweep_uploads_task(**_: Any) -> None:
    sweep_uploads()
