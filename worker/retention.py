"""File retention: a beat sweep that deletes files whose ``expires_at`` has passed.

Every ``settings.file_sweep_interval_s`` the sweep takes expired ``files`` rows (uploads get
``expires_at`` from the API, batch output and error files from the finalize: the batch's
``output_expires_after`` seconds after it, or ``settings.file_expiry_s``), deletes each row,
and after that commits deletes the stored object. The API already answers 404 for an expired file, so the order is invisible.
A batch's results log (its checkpoint chunks, :mod:`core.results_log`) goes with the first of
its output and error files to be swept.

An input file that a batch still needs is never deleted: the shards read their line ranges
from it, and a cancel/expiry finalize reads it to name the requests that never ran. A file
referenced as ``input_file_id`` by a batch that is not terminal is skipped, and deleted by a
later sweep once the batch has ended. (The same holds for ``DELETE /v1/files``: deleting a file
that a running batch reads should only expire it, leaving the deletion to this sweep.)
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import delete, exists, select

from core import results_log
from core.db import session_scope
from core.lifecycle import TERMINAL, now
from core.queue import TASK_SWEEP_FILES
from core.results_log import batch_log_prefix
from core.tables import Batch, File
from worker.celery_app import app
from worker.common import storage

logger = logging.getLogger(__name__)

BATCH_SIZE = 500  # rows per transaction


def _in_use():
    """A correlated condition: a batch that has not ended reads this file."""
    return exists().where(Batch.input_file_id == File.id, Batch.status.not_in(tuple(TERMINAL)))


def sweep_files(limit: int | None = None) -> int:
    """Delete expired files (row, then stored object); return how many were deleted."""
    deleted = 0
    sto = storage()
    while limit is None or deleted < limit:
        current = now()
        take = BATCH_SIZE if limit is None else min(BATCH_SIZE, limit - deleted)
        with session_scope() as session:
            query = (
                select(File.id, File.storage_key)
                .where(File.expires_at.is_not(None), File.expires_at <= current, ~_in_use())
                .order_by(File.expires_at)
                .limit(take)
            )
            if session.get_bind().dialect.name == "postgresql":
                query = query.with_for_update(skip_locked=True)  # concurrent sweeps split work
            rows = session.execute(query).all()
            if not rows:
                break
            # Re-check in the DELETE itself: a batch created meanwhile keeps its file.
            gone = set(
                session.scalars(
                    delete(File)
                    .where(
                        File.id.in_([r.id for r in rows]),
                        File.expires_at <= current,
                        ~_in_use(),
                    )
                    .returning(File.id)
                    .execution_options(synchronize_session=False)
                ).all()
            )
            logs = results_log.drop_for_files(session, gone)
        for batch_id in logs:
            try:
                sto.delete_prefix(batch_log_prefix(batch_id))
            except Exception:
                logger.exception("batch %s: results log forgotten, its chunks were not", batch_id)
        for file_id, key in rows:
            if file_id not in gone:
                continue
            try:
                sto.delete(key)
            except Exception:
                logger.exception("file %s: row deleted, stored object %s was not", file_id, key)
        deleted += len(gone)
        if len(rows) < take:
            break
    if deleted:
        logger.info("retention: deleted %s expired files", deleted)
    return deleted


@app.task(name=TASK_SWEEP_FILES)
def sweep_files_task(**_: Any) -> None:
    sweep_files()
