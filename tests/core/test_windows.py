"""Completion windows are read whole: a trailing newline is not a window."""

from __future__ import annotations

import pytest

from core.batches.completion_windows import window_seconds


@pytest.mark.parametrize(
    ("window", "seconds"),
    [("24h", 86400), ("90m", 5400), ("7d", 604800), ("24h\n", None), (" 24h", None),
     ("0h", None), ("24", None)],
)  # fmt: skip
def test_window_seconds(window: str, seconds: int | None) -> None:
    assert window_seconds(window) == seconds
