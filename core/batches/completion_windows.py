"""Completion windows: ``"24h"`` (OpenAI's only value) and batchd's ``<n>s|m|h|d``."""

from __future__ import annotations

import re

# Anchored for the OpenAPI schema's pattern; matched with fullmatch (``$`` alone would let a
# trailing newline through: "24h\n").
WINDOW = re.compile(r"^([1-9][0-9]{0,9})([smhd])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int | None:
    """``"24h"`` -> 86400; None when ``window`` is not ``<n>s|m|h|d``."""
    match = WINDOW.fullmatch(window)
    if not match:
        return None
    return int(match.group(1)) * UNIT_SECONDS[match.group(2)]


def duration(seconds: int) -> str:
    """``86400`` -> ``"1d"``: the largest unit that divides it."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
