"""Per-request timings of the generations this process ran, for ``batchd bench``.

Each finished request's submit, admit, first-token and finish times (``time.time()``) and token
counts sit in a bounded buffer (``MAX_RECORDS``), beside each result's lag from its finish to
its chunk's commit. Nothing is written elsewhere; Celery remote control reads them::

    app.control.broadcast("request_timings", arguments={"batch_ids": [...]}, reply=True)
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from celery.worker.control import inspect_command

if TYPE_CHECKING:
    from engine import RequestOutput

MAX_RECORDS = 200_000
FIELDS = (
    "batch_id",
    "shard",
    "custom_id",
    "submitted",
    "admitted",
    "first_token",
    "finished",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
)

_lock = threading.Lock()
_records: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=MAX_RECORDS)
_lags: collections.deque[tuple[str, float]] = collections.deque(maxlen=MAX_RECORDS)


def record(
    batch_id: str, shard: int, custom_id: str, submitted: float | None, output: RequestOutput
) -> None:
    """Keep the timings of one finished request (an engine ``RequestOutput``)."""
    metrics = getattr(output, "metrics", None)
    if metrics is None:
        return
    outputs = getattr(output, "outputs", None) or ()
    row = (
        batch_id,
        int(shard),
        str(custom_id),
        submitted,
        getattr(metrics, "arrival_time", None),
        getattr(metrics, "first_token_time", None),
        getattr(metrics, "finished_time", None) or time.time(),
        len(getattr(output, "prompt_token_ids", None) or ()),
        int(getattr(metrics, "num_cached_tokens", 0) or 0),
        sum(len(c.token_ids) for c in outputs),
    )
    with _lock:
        _records.append(row)


def record_commit(batch_id: str, finished: list[float | None], committed: float) -> None:
    """Keep the finish-to-commit lag of each result of one committed chunk."""
    lags = [(batch_id, committed - t) for t in finished if t is not None]
    if lags:
        with _lock:
            _lags.extend(lags)


def commit_lags(batch_ids: list[str] | None = None) -> list[float]:
    """The kept finish-to-commit lags (seconds) of ``batch_ids`` (all when None)."""
    wanted = set(batch_ids) if batch_ids is not None else None
    with _lock:
        rows = list(_lags)
    return [lag for b, lag in rows if wanted is None or b in wanted]


def records(batch_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """The kept records of ``batch_ids`` (every record when None), oldest first."""
    wanted = set(batch_ids) if batch_ids is not None else None
    with _lock:
        rows = list(_records)
    return [dict(zip(FIELDS, r, strict=True)) for r in rows if wanted is None or r[0] in wanted]


@inspect_command(name="request_timings", args=[("batch_ids", list)])
def _request_timings(state: Any, batch_ids: list[str] | None = None, **_: Any) -> dict:
    return {
        "pid": os.getpid(),
        "records": records(batch_ids),
        "commit_lags": commit_lags(batch_ids),
    }
