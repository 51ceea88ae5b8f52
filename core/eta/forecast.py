"""Projected completion times: a model's recent throughput, the work ahead of a batch, and
when the batch should start and finish. Pure arithmetic on unix seconds and estimated tokens
(a request's prompt plus ``max_tokens × n``: the unit shards are planned in, and throughput is
counted in it too, so generous output bounds cancel out); :mod:`core.eta.store` reads the
numbers from the database. How each function counts, and why a running batch's rate blends its
whole run with a recent window, is in docs/core.md."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

#: Less busy time than this in the window is no measurement.
MIN_BUSY_S = 1.0
#: A running batch's own rate is used once it has run this long and retired some work.
MIN_ELAPSED_S = 1.0
#: A running batch's recent window is this fraction of the time it has run (the later part),
RECENT_FRACTION = 0.5
#: at least this long (a shorter run is all recent), at most the caller's ``max_window_s``;
RECENT_MIN_S = 10.0
#: its rate weighs this much against the rate since the start.
RECENT_WEIGHT = 0.7


@dataclass(frozen=True, slots=True)
class Span:
    """A batch's activity: from its first shard's release to its end (or now), and the
    estimated tokens it retired in that time."""

    start: float
    end: float
    work: float


@dataclass(frozen=True, slots=True)
class Queued:
    """A batch's remaining work, as the queue sees it: its tenant, priority rank (0 is
    ``high``), deadline (``expires_at``) and remaining estimated tokens."""

    tenant: str
    rank: int
    deadline: float
    remaining: float


@dataclass(frozen=True, slots=True)
class Ahead:
    """``before``: work that runs before the batch starts (higher tiers, the tenant's own
    earlier deadlines, and the other tenants' part of the same tier alongside those);
    ``total``: everything that runs before or beside it until it ends, its own work excluded."""

    before: float
    total: float


@dataclass(frozen=True, slots=True)
class Projection:
    start: float
    finish: float


def throughput(
    spans: Iterable[Span], *, now: float, window_s: float, min_busy_s: float = MIN_BUSY_S
) -> float | None:
    """Estimated tokens per second retired over ``[now - window_s, now]``; None when fewer
    than ``min_busy_s`` seconds of it saw a batch running or nothing was retired."""
    low = now - window_s
    total = 0.0
    pieces: list[tuple[float, float]] = []
    for span in spans:
        end = min(span.end, now)
        if span.work <= 0 or end <= span.start:
            continue
        a, b = max(span.start, low), end
        if b <= a:
            continue
        total += span.work * (b - a) / (end - span.start)
        pieces.append((a, b))
    busy = _union_length(pieces)
    if busy < min_busy_s or total <= 0:
        return None
    return total / busy


def _union_length(pieces: list[tuple[float, float]]) -> float:
    length, reach = 0.0, float("-inf")
    for a, b in sorted(pieces):
        if b <= reach:
            continue
        length += b - max(a, reach)
        reach = b
    return length


def work_ahead(
    queue: Iterable[Queued], *, tenant: str, rank: int, deadline: float, work: float
) -> Ahead:
    """The work that runs before and beside a batch of ``work`` tokens (see the module
    docstring); ``queue`` must not hold the batch itself."""
    higher = own = 0.0
    others: dict[str, float] = defaultdict(float)
    for q in queue:
        if q.remaining <= 0 or q.rank > rank:
            continue
        if q.rank < rank:
            higher += q.remaining
        elif q.tenant == tenant:
            if q.deadline <= deadline:
                own += q.remaining
        else:
            others[q.tenant] += q.remaining
    before = higher + own + sum(min(theirs, own) for theirs in others.values())
    beside = sum(min(theirs, own + work) for theirs in others.values())
    return Ahead(before=before, total=higher + own + beside)


def project(ahead: Ahead, work: float, rate: float | None, now: float) -> Projection | None:
    """Start and finish at ``rate`` estimated tokens per second; None without a rate."""
    if rate is None or rate <= 0:
        return None
    return Projection(start=now + ahead.before / rate, finish=now + (ahead.total + work) / rate)


def retired(spans: Iterable[Span], *, low: float, now: float) -> float:
    """The work of ``spans`` retired within ``[low, now]``, each span's work spread evenly
    over its span (a span still running ends at ``now``)."""
    total = 0.0
    for span in spans:
        end = min(span.end, now)
        if span.work <= 0 or end <= span.start:
            continue
        inside = end - max(span.start, low)
        if inside > 0:
            total += span.work * inside / (end - span.start)
    return total


def recent_window_s(elapsed: float, max_window_s: float) -> float:
    """The recent window of a batch that has run ``elapsed`` seconds: the later
    ``RECENT_FRACTION`` of its run, at least ``RECENT_MIN_S``, at most ``max_window_s`` and
    never longer than the run."""
    return min(elapsed, max(RECENT_MIN_S, min(RECENT_FRACTION * elapsed, max_window_s)))


def own_rate(
    started: float | None,
    done: float,
    shards: Iterable[Span],
    now: float,
    *,
    max_window_s: float,
) -> float | None:
    """A running batch's rate in estimated tokens per second: ``RECENT_WEIGHT`` of the rate
    of its recent window (:func:`recent_window_s`; the work its ``shards`` retired in it, each
    shard a span from its release to its end, or now, with its committed work) and the rest
    of ``done`` over the time since ``started``. ``shards`` must hold every shard that ran
    within the window (older ones may be left out). None before the batch has run
    ``MIN_ELAPSED_S`` or while it has retired nothing."""
    if started is None or done <= 0:
        return None
    elapsed = now - started
    if elapsed < MIN_ELAPSED_S:
        return None
    whole = done / elapsed
    window = recent_window_s(elapsed, max_window_s)
    recent = retired(shards, low=now - window, now=now) / window
    return RECENT_WEIGHT * recent + (1 - RECENT_WEIGHT) * whole


def from_progress(
    started: float | None,
    done: float,
    total: float,
    now: float,
    shards: Iterable[Span],
    *,
    max_window_s: float,
) -> float | None:
    """A running batch's finish at its own rate (:func:`own_rate`), ``done`` of ``total``
    estimated tokens retired; None before it has a rate."""
    if total <= 0:
        return None
    rate = own_rate(started, done, shards, now, max_window_s=max_window_s)
    if rate is None or rate <= 0:
        return None
    return now + max(0.0, total - done) / rate


def at_risk(finish: float | None, deadline: float) -> bool:
    """Projected to end after its deadline (unknown projections are not at risk)."""
    return finish is not None and finish > deadline
