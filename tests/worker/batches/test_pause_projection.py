"""A paused batch keeps the projection it had when paused: the refresh (real rows in
Postgres) leaves it alone, while the batch object moves it by the time paused so far; the
same batch resumed is projected from its progress again."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from core.database.sessions import session_scope
from core.database.tables import Batch
from core.eta import store
from tests.core.test_eta_store import _batch, _shard


def test_the_refresh_leaves_a_paused_batch_projection_alone(pg_url: str):
    now = datetime.now(UTC).replace(microsecond=0)
    model = f"eta-pause-{secrets.token_hex(4)}"
    kept = now + timedelta(seconds=123)
    with session_scope(pg_url) as session:
        batch_id = _batch(session, model, now, started_s_ago=1000)
        _shard(session, batch_id, 0, now, est=3000, done_of_10=10, released=1000, ended=700)
        _shard(session, batch_id, 1, now, est=8000, done_of_10=5, released=250)
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(paused_at=now - timedelta(seconds=30), estimated_completion_at=kept)
        )
    with session_scope(pg_url) as session:
        store.refresh(session, now, window_s=900)
    with session_scope(pg_url) as session:
        stored = session.scalar(select(Batch.estimated_completion_at).where(Batch.id == batch_id))
        assert stored == kept
        session.execute(update(Batch).where(Batch.id == batch_id).values(paused_at=None))
    with session_scope(pg_url) as session:
        store.refresh(session, now, window_s=900)
    with session_scope(pg_url) as session:
        stored = session.scalar(select(Batch.estimated_completion_at).where(Batch.id == batch_id))
        assert stored is not None and stored != kept
