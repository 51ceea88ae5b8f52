"""The results log on real Postgres and storage with an in-process engine host: what a page
shows while a shard is interrupted, the ``batch_expired`` lines an expiry finalize adds, the
union of pages equal to the final files, and retention dropping the log with the files."""

from __future__ import annotations

from datetime import timedelta

import pytest

from testkit.builders.worker import batch_row, chat_line, make_batch, read_file_lines, shard_rows

pytestmark = pytest.mark.services


class Interrupted(Exception):
    pass


def _all_pages(batch_id: str, limit: int) -> list[dict]:
    """Every logged line, paged as a client would (each page after the last id seen)."""
    from core.database.results_log import cursor_seq, read_page
    from core.database.sessions import session_scope
    from worker.infra.task_io import storage

    lines: list[dict] = []
    start = 0
    while True:
        with session_scope() as session:
            page = read_page(session, storage(), batch_id, start=start, limit=limit)
            if page.data:
                start = cursor_seq(session, batch_id, page.data[-1]["id"]) + 1
        lines += page.data
        if not page.has_more:
            return lines


def test_expired_batch_log_equals_its_files_and_retention_drops_it(worker_env, host):
    from sqlalchemy import select, update

    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File, ResultChunk, ResultLine, Shard
    from worker.batches.finalize import finalize
    from worker.batches.retention import sweep_files
    from worker.batches.tasks import validate
    from worker.infra.task_io import storage
    from worker.shards.task import run_shard

    lines = [chat_line(f"r{i}", f"item {i}", max_tokens=5) for i in range(10)]
    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress"
    assert _all_pages(batch_id, 3) == []  # nothing durable yet
    (shard,) = shard_rows(batch_id)

    def stop(chunk: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=stop)  # 1 result committed, then dies
    committed = _all_pages(batch_id, 3)
    assert len(committed) == 1 == batch_row(batch_id).request_completed

    with session_scope() as session:  # the dead attempt goes stale and the window passes
        session.execute(update(Shard).values(heartbeat_at=now() - timedelta(hours=1)))
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(expires_at=now() - timedelta(seconds=1))
        )
    assert finalize(batch_id) == "expired"
    batch = batch_row(batch_id)
    final = read_file_lines(batch.output_file_id) + read_file_lines(batch.error_file_id)
    for limit in (1, 4, 1000):
        pages = _all_pages(batch_id, limit)
        assert len({line["id"] for line in pages}) == len(pages) == 10
        assert sorted(pages, key=lambda r: r["id"]) == sorted(final, key=lambda r: r["id"])
        assert pages[:1] == committed  # in commit order: the finalize's lines come last
        assert {r["error"]["code"] for r in pages[1:]} == {"batch_expired"}

    # Retention: the log goes with the first of the batch's result files to be swept.
    with session_scope() as session:
        session.execute(
            update(File)
            .where(File.id.in_([batch.output_file_id, batch.error_file_id]))
            .values(expires_at=now() - timedelta(seconds=1))
        )
    assert sweep_files() >= 2
    with session_scope() as session:
        assert (
            session.scalars(select(ResultChunk).where(ResultChunk.batch_id == batch_id)).all() == []
        )
        assert (
            session.scalars(select(ResultLine).where(ResultLine.batch_id == batch_id)).all() == []
        )
    assert storage().list(f"batches/{batch_id}/") == []
