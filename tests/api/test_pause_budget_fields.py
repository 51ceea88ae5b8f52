"""What the batch object and /ui show of a pause and of a token budget: a paused batch's
projection moves with the time it has been paused (its window's clock runs on), and turns
at_risk once that passes its deadline; the budget shows beside what was spent."""

from __future__ import annotations

from datetime import timedelta

from api.schemas import BatchCreate, BatchPublic
from api.ui import _batch_rows
from core.database.lifecycle import BatchStatus, now
from core.database.tables import Batch


def _row(**values) -> Batch:
    start = now()
    fields = {
        "id": "batch_p",
        "tenant": "t",
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "input_file_id": "file-p",
        "completion_window": "24h",
        "status": BatchStatus.IN_PROGRESS,
        "created_at": start - timedelta(hours=1),
        "expires_at": start + timedelta(seconds=500),
        "estimated_completion_at": start + timedelta(seconds=300),
        "at_risk": False,
        "input_tokens": 120,
        "output_tokens": 30,
    }
    return Batch(**{**fields, **values})


def test_a_paused_batch_projection_moves_with_the_time_paused_and_turns_at_risk():
    running = BatchPublic.of(_row())
    assert not running.paused and running.paused_at is None and running.at_risk is False
    paused_at = now() - timedelta(seconds=600)
    paused = BatchPublic.of(_row(paused_at=paused_at))
    assert paused.paused and paused.paused_at == int(paused_at.timestamp())
    assert paused.status == "in_progress"  # the SDK's set; the flag says it is paused
    assert running.estimated_completion_at is not None
    assert paused.estimated_completion_at is not None
    moved = paused.estimated_completion_at - running.estimated_completion_at
    assert 599 <= moved <= 602  # the stored projection, later by the 600 s paused so far
    assert paused.at_risk is True  # now past expires_at: 300 + 600 > 500
    briefly = BatchPublic.of(_row(paused_at=now() - timedelta(seconds=60)))
    assert briefly.paused and briefly.at_risk is False  # 300 + 60 < 500


def test_an_ended_batch_is_not_shown_paused():
    ended = BatchPublic.of(_row(status=BatchStatus.CANCELLED, paused_at=now()))
    assert not ended.paused and ended.paused_at is None


def test_the_budget_shows_beside_what_was_spent():
    shown = BatchPublic.of(_row(max_total_tokens=1000))
    assert shown.max_total_tokens == 1000
    assert shown.usage.total_tokens == 150  # what it spent
    assert BatchPublic.of(_row()).max_total_tokens is None


def test_the_budget_on_create_is_a_positive_integer():
    body = {"input_file_id": "file-p", "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}  # fmt: skip
    assert BatchCreate(**body, max_total_tokens=5).max_total_tokens == 5
    for bad in (0, -3, "many", 1.5):
        try:
            BatchCreate(**body, max_total_tokens=bad)
        except ValueError as error:
            assert "max_total_tokens" in str(error)
        else:
            raise AssertionError(f"max_total_tokens={bad!r} was accepted")


def test_the_dashboard_row_shows_the_pause_and_the_budget():
    row = {
        "id": "batch_p",
        "tenant": "t",
        "model": "m",
        "status": "in_progress",
        "total": 10,
        "completed": 3,
        "failed": 1,
        "progress": 0.4,
        "throughput": None,
        "eta_s": None,
        "at_risk": False,
        "prompt_tokens": 120,
        "cached_tokens": 0,
        "shareable_tokens": 0,
        "paused": True,
        "max_total_tokens": 2000,
        "spent_tokens": 1500,
        "created_at": None,
    }
    html = _batch_rows([row], admin=False)
    assert "in_progress (paused)" in html
    assert "4 / 10 · 1.5k of 2.0k tokens" in html
    plain = _batch_rows([{**row, "paused": False, "max_total_tokens": None}], admin=False)
    assert "(paused)" not in plain and "tokens</td>" not in plain
