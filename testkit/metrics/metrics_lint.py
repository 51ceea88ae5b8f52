"""The rules every batchd metric follows (see core/observability/metrics.py): ``batchd_`` names in
snake case, labels from a short allowed list, and no label value that names one job."""

from __future__ import annotations

import re

from testkit.metrics.scrape import Samples

NAME = re.compile(r"^batchd_[a-z][a-z0-9_]*$")
# Each label's values come from a fixed set or from configuration and accounts.
ALLOWED_LABELS = {
    "model",  # a served model (BATCHD_MODELS)
    "tenant",  # an account
    "status",  # a batch or shard status, or an HTTP status code
    "state",  # unreleased | released | running
    "reason",  # a refusal reason
    "outcome",  # a finalize's or a webhook delivery's outcome
    "finished_reason",  # stop | length
    "handler",  # an API route template, never a concrete path
    "method",  # an HTTP method
}
BOUNDED_VALUES = {
    "reason": {
        "unauthorized",
        "not_found",
        "payload_too_large",
        "rate_limited",
        "token_limit_exceeded",
        # an upstream's back-offs
        *("429", "502", "503", "504", "timeout", "connection"),
    },
    "outcome": {
        "delivered",
        "refused",
        "failed",
        "retrying",  # webhooks
        "completed",
        "expired",
        "cancelled",  # finalizes
    },  # fmt: skip
    "state": {"unreleased", "released", "running"},
    "finished_reason": {"stop", "length", "abort", "unknown"},
}
# What an id looks like here: batch_…, file-…, shard/request ids, UUIDs, long hex runs.
ID_LIKE = re.compile(r"(batch_|file-|req[-_]|[0-9a-f]{16,}|[0-9a-f]{8}-[0-9a-f]{4}-)")


def problems(families: list[tuple[str, list[str]]]) -> list[str]:
    """Rule breaks among ``(metric name, label names)`` pairs of batchd's metrics."""
    out = []
    for name, labels in families:
        if not NAME.match(name):
            out.append(f"{name}: not a batchd_ snake-case name")
        for label in labels:
            if label not in ALLOWED_LABELS:
                out.append(f"{name}: label {label!r} is not on the allowed list")
    return out


def sample_problems(samples: Samples, forbidden: set[str] = frozenset()) -> list[str]:
    """Label values of scraped ``batchd_*`` samples that are unbounded: an id, a value outside
    its label's fixed set, or one of ``forbidden`` (the ids of the job just run)."""
    out = []
    for name, labels in samples:
        if not name.startswith("batchd_"):
            continue
        for label, v in labels:
            if label == "le":
                continue
            if label not in ALLOWED_LABELS:
                out.append(f"{name}: label {label!r}")
            elif label in BOUNDED_VALUES and v not in BOUNDED_VALUES[label]:
                out.append(f"{name}: {label}={v!r} is not one of {sorted(BOUNDED_VALUES[label])}")
            elif label != "handler" and ID_LIKE.search(v):
                out.append(f"{name}: {label}={v!r} looks like an id")
            elif label == "handler" and v != "none" and not v.startswith("/"):
                out.append(f"{name}: handler={v!r} is not a route template")
            elif any(f in v for f in forbidden):
                out.append(f"{name}: {label}={v!r} names a job")
    return out
