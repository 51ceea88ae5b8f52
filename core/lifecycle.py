"""Batch state transitions. Each is one conditional UPDATE, so two actors never both win.

validating -> in_progress -> finalizing -> completed
validating -> failed
validating | in_progress -> cancelling -> cancelled
validating | in_progress | finalizing -> expired   (via the expiry sweep)
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from core.models import Batch

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
ALLOWED: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling", "expired"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired", "failed"}),
    "finalizing": frozenset({"completed", "failed", "expired"}),
    "cancelling": frozenset({"cancelled"}),
}
# The timestamp column stamped when a batch enters each status.
STAMP = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


def now() -> datetime:
    return datetime.now(UTC)


def transition(
    session: Session,
    batch_id: str,
    expected: str | Iterable[str],
    target: str,
    **values: Any,
) -> bool:
    """Move ``batch_id`` from one of ``expected`` to ``target``; True if this caller won.

    ``values`` are extra columns set in the same UPDATE. The caller commits.
    """
    sources = {expected} if isinstance(expected, str) else set(expected)
    for source in sources:
        if target not in ALLOWED.get(source, ()):
            raise ValueError(f"illegal batch transition {source} -> {target}")
    values.setdefault(STAMP[target], now())
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(sources))
        .values(status=target, **values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1
