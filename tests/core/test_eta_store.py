"""A running batch's projected completion as the refresh stores it, read from real shard rows
in Postgres: the whole-run rate blended with the rate of its recent window, where a finished
shard's span ends at its last update and shards that ended before the window are not read."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from core.database.lifecycle import BatchStatus, ShardStatus
from core.database.sessions import session_scope
from core.database.tables import Batch, Shard
from core.eta import forecast, store


def _batch(session, model: str, now: datetime, started_s_ago: float) -> str:
    batch_id = f"batch_{secrets.token_hex(8)}"
    session.add(
        Batch(
            id=batch_id,
            tenant="t",
            endpoint="/v1/chat/completions",
            model=model,
            input_file_id="file-x",
            completion_window="24h",
            status=BatchStatus.IN_PROGRESS,
            expires_at=now + timedelta(hours=24),
            in_progress_at=now - timedelta(seconds=started_s_ago),
        )
    )
    session.flush()
    return batch_id


def _shard(session, batch_id, index, now, *, est, done_of_10, released=None, ended=None):
    status = ShardStatus.PENDING if released is None else ShardStatus.RUNNING
    if ended is not None:
        status = ShardStatus.DONE
    session.add(
        Shard(
            batch_id=batch_id,
            index=index,
            status=status,
            start_line=1 + 10 * index,
            end_line=11 + 10 * index,
            start_offset=0,
            end_offset=0,
            num_requests=10,
            est_tokens=est,
            done_requests=done_of_10,
            released_at=None if released is None else now - timedelta(seconds=released),
            updated_at=now - timedelta(seconds=ended or 0),
        )
    )


def _stored(session, batch_id: str) -> float | None:
    value = session.scalar(select(Batch.estimated_completion_at).where(Batch.id == batch_id))
    return None if value is None else value.timestamp()


def test_refresh_blends_the_recent_window_read_from_the_shards(pg_url: str):
    now = datetime.now(UTC).replace(microsecond=0)
    model = f"eta-{secrets.token_hex(4)}"
    with session_scope(pg_url) as session:
        batch_id = _batch(session, model, now, started_s_ago=1000)
        # Started 1000 s ago: its window is the last 500 s. Shard 0 ended before it (none of
        # its work counts there), shard 1 ended 250 s into it (spread over its 500 s span:
        # half of it inside), shard 2 runs (half done), shard 3 was never released.
        _shard(session, batch_id, 0, now, est=3000, done_of_10=10, released=1000, ended=700)
        _shard(session, batch_id, 1, now, est=2000, done_of_10=10, released=750, ended=250)
        _shard(session, batch_id, 2, now, est=8000, done_of_10=5, released=250)
        _shard(session, batch_id, 3, now, est=1000, done_of_10=0)
        idle_id = _batch(session, f"{model}-idle", now, started_s_ago=10)
        _shard(session, idle_id, 0, now, est=500, done_of_10=0, released=10)
    with session_scope(pg_url) as session:
        store.refresh(session, now, window_s=900)
    with session_scope(pg_url) as session:
        done, total = 3000 + 2000 + 4000, 14_000
        whole = done / 1000
        recent = (1000 + 4000) / 500
        rate = forecast.RECENT_WEIGHT * recent + (1 - forecast.RECENT_WEIGHT) * whole
        want = now.timestamp() + (total - done) / rate
        assert _stored(session, batch_id) == pytest.approx(want, abs=1.0)
        # At the whole-run rate alone it would be later (its recent rate is higher).
        assert want < now.timestamp() + (total - done) / whole - 10
        # Nothing committed yet and no throughput of its model: no number is made up.
        assert _stored(session, idle_id) is None
