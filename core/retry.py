"""Retrying what did not succeed: which result lines a retry takes, and how a batch's results
read once its retries have run.

A retry batch (``POST /v1/batches/{id}/retry``) is made of the parent's input lines whose
results are in :data:`RETRY_KINDS` (by default all three):

* ``expired`` / ``cancelled``: the request never ran (``batch_expired``/``batch_cancelled``);
* ``failed``: the request ran and failed for a reason that may pass next time: a 5xx (the
  engine failed, a shard was given up) or a 429. A 4xx is the request's own fault (too long
  for the context, a value the model cannot honour) and would fail again, so it is never
  retried; neither is a validation error, which fails the whole batch before anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

RETRY_KINDS = ("expired", "cancelled", "failed")
RETRY_OF = "retry_of"  # the metadata key naming a retry's parent batch

_NEVER_RAN = {"batch_expired": "expired", "batch_cancelled": "cancelled"}


def retry_kind(line: dict[str, Any]) -> str | None:
    """The kind of a result line a retry may take (one of :data:`RETRY_KINDS`), or None for a
    success or an error that would happen again."""
    response = line.get("response")
    if response is None:
        error = line.get("error")
        return _NEVER_RAN.get(error.get("code")) if isinstance(error, dict) else None
    if not isinstance(response, dict):
        return None
    status = response.get("status_code")
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
