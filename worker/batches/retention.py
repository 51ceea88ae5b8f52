"""File retention: a beat sweep that deletes files whose ``expires_at`` has passed.

Every ``file_sweep_interval_s`` it deletes expired ``files`` rows, then their objects (the API
already answers 404 for them), and a batch's results log with the first of its output files.
An input file that a batch not yet ended still reads is skipped until the batch has ended.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import delete, exists, select

from core.broker.queue import TASK_SWEEP_FILES
from core.database import results_log
from core.database.lifecycle import TERMINAL, now
from core.database.results_log import batch_log_prefix
from core.database.sessions import session_scope
from core.database.tables import Batch, File
from worker.infra import app, storage

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
