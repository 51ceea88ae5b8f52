"""The projected completion a running batch shows beside its deadline."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from api.schemas import BatchPublic
from core.database.lifecycle import BatchStatus
from core.database.tables import Batch


@pytest.mark.parametrize("late_by_s", [0.001, 0.4, 0.999, 1.0, 61.5])
def test_a_batch_at_risk_shows_a_completion_past_its_deadline(late_by_s: float):
    # Stored times carry microseconds; the object shows whole seconds. A projection less than
    # a second past the deadline must still read as past it.
    expires = datetime(2026, 12, 7, 3, 0, 0, 250_000, tzinfo=UTC)
    row = Batch(
        id="batch_x",
        tenant="t",
        endpoint="/v1/chat/completions",
        model="m",
        input_file_id="file-x",
        completion_window="24h",
        status=BatchStatus.IN_PROGRESS,
        created_at=expires - timedelta(hours=24),
        expires_at=expires,
        estimated_completion_at=expires + timedelta(seconds=late_by_s),
        at_risk=True,
    )
    shown = BatchPublic.of(row)
    assert shown.at_risk
    assert shown.expires_at is not None and shown.estimated_completion_at is not None
    assert shown.estimated_completion_at > shown.expires_at


def test_a_batch_that_ended_shows_no_projection():
    row = Batch(
        id="batch_y",
        tenant="t",
        endpoint="/v1/chat/completions",
        model="m",
        input_file_id="file-x",
        completion_window="24h",
        status=BatchStatus.COMPLETED,
        created_at=datetime(2026, 12, 7, tzinfo=UTC),
        estimated_completion_at=datetime(2026, 12, 7, 1, tzinfo=UTC),
        at_risk=True,
    )
    shown = BatchPublic.of(row)
    assert shown.estimated_completion_at is None and not shown.at_risk
