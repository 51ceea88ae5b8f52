"""A batch's priority (core.batches.priority): its order, its number for the engine, the names read
from rows and requests, and what a key's highest priority allows."""

from __future__ import annotations

import pytest

from core.batches.priority import Priority, priority_name
from core.database.auth import priority_allowed


def test_most_urgent_first_in_every_scale() -> None:
    assert list(Priority) == [Priority.HIGH, Priority.NORMAL, Priority.LOW]
    assert [p.rank for p in Priority] == [0, 1, 2]
    assert [p.engine for p in Priority] == [-1, 0, 1]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("high", Priority.HIGH), ("low", Priority.LOW), ("normal", Priority.NORMAL),
     (None, Priority.NORMAL), ("urgent", Priority.NORMAL), ("", Priority.NORMAL),
     ("HIGH", Priority.NORMAL)],
)  # fmt: skip
def test_parsing_falls_back_to_normal(value: str | None, expected: Priority) -> None:
    assert Priority.parse(value) is expected
    assert priority_name(value) == expected.value


def test_a_keys_highest_priority_allows_itself_and_below() -> None:
    assert priority_allowed("low", "normal") and priority_allowed("normal", "normal")
    assert not priority_allowed("high", "normal")
    assert all(priority_allowed(p, "high") for p in Priority)
    assert [p for p in Priority if priority_allowed(p, "low")] == [Priority.LOW]
    with pytest.raises(ValueError):
        priority_allowed("urgent", "high")
