"""Retrying what did not succeed: which result lines a retry takes, and how a batch's results
read once its retries have run.

A retry batch is made of the parent's input lines whose results are in :data:`RETRY_KINDS`:
``expired``, ``cancelled`` and ``budget_exhausted`` (never ran; the last a 429 whose code says
the batch's token budget was spent) and ``failed`` (a 5xx or another 429, which may pass next
time; a 4xx is the request's own fault and is never retried). :class:`LineSelection` narrows
it to 1-based line numbers and inclusive ranges ``[first, last]``."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

RETRY_KINDS = ("expired", "cancelled", "budget_exhausted", "failed")
RETRY_OF = "retry_of"  # the metadata key naming a retry's parent batch

_NEVER_RAN = {"batch_expired": "expired", "batch_cancelled": "cancelled"}


def _error_code(response: dict[str, Any]) -> Any:
    body = response.get("body")
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def retry_kind(line: dict[str, Any]) -> str | None:
    """The kind of a result line a retry may take (one of :data:`RETRY_KINDS`), or None for a
    success or an error that would happen again."""
    response = line.get("response")
    if response is None:
        error = line.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return _NEVER_RAN.get(code) if isinstance(code, str) else None
    if not isinstance(response, dict):
        return None
    status = response.get("status_code")
    if status == 429 and _error_code(response) == "budget_exhausted":
        return "budget_exhausted"  # never ran: its batch's token budget was spent
    if isinstance(status, int) and (status >= 500 or status == 429):
        return "failed"
    return None


def merge_with_retries(
    order: Sequence[str], layers: Iterable[Iterable[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One line per ``custom_id``, in ``order`` (the parent's input order): each the line of
    the last layer that has one. ``layers`` are the parent's result lines, then each retry's,
    oldest first. Lines under a ``custom_id`` not in ``order`` follow, in the order seen."""
    latest: dict[Any, dict[str, Any]] = {}
    for layer in layers:
        for line in layer:
            latest[line.get("custom_id")] = line
    merged = [latest.pop(custom_id) for custom_id in order if custom_id in latest]
    return merged + list(latest.values())


#: The most items (numbers and ranges) one retry's ``lines`` may hold.
MAX_LINE_ITEMS = 1000


class LineSelection:
    """Line numbers of a file, from numbers and inclusive ``[first, last]`` ranges, held as
    merged intervals (a range of a million lines costs two integers). ``singles`` are the
    numbers named on their own: each must name a request line."""

    def __init__(self, items: Iterable[int | Sequence[int]]) -> None:
        self.items: list[tuple[int, int]] = []
        self.singles: set[int] = set()
        for item in items:
            if isinstance(item, int):
                self.items.append((item, item))
                self.singles.add(item)
            else:
                first, last = item
                self.items.append((first, last))
        merged: list[list[int]] = []
        for first, last in sorted(self.items):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._starts = [first for first, _ in merged]
        self._ends = [last for _, last in merged]

    def __contains__(self, line: int) -> bool:
        at = bisect.bisect_right(self._starts, line) - 1
        return at >= 0 and line <= self._ends[at]

    def normalized(self) -> list[list[int]]:
        """The same lines as sorted, disjoint, non-adjacent ``[first, last]`` ranges: two
        selections of the same lines compare equal whatever their spelling."""
        return [[first, last] for first, last in zip(self._starts, self._ends, strict=True)]

    def past(self, last_line: int) -> list[str]:
        """The items, as asked, that reach past ``last_line``."""
        return [describe_lines(first, last) for first, last in self.items if last > last_line]


def describe_lines(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def name_lines(lines: Sequence[str | int], most: int = 10) -> str:
    """``1, 4, 9-12`` (the first ``most``, then how many more)."""
    named = ", ".join(str(line) for line in lines[:most])
    return named if len(lines) <= most else f"{named} and {len(lines) - most} more"
