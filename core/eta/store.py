"""Projected completions from the database: each model's recent batches and their progress
(the shards' checkpointed ``done_requests``, the same progress the service's metrics count),
the arithmetic of :mod:`core.eta.forecast`, and the ``estimated_completion_at``/``at_risk``
columns of running batches, refreshed every few seconds by the control worker
(``worker.validation.estimate``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import Float, and_, case, cast, func, or_, select, update
from sqlalchemy.orm import Session

from core.batches.priority import Priority
from core.database.lifecycle import BatchStatus, ShardStatus
from core.database.tables import Batch, Shard
from core.eta import forecast

logger = logging.getLogger(__name__)

#: Batches whose shards run (or ran until a moment ago): their spans count as activity.
_RUNNING = (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)
#: A stored projection that moved less than this is not written again.
_MOVE_S = 1.0


def rank(priority: str) -> int:
    """The rank :mod:`core.eta.forecast` compares (0 is ``high``); ``normal`` if unknown."""
    return Priority.parse(priority).rank


@dataclass(frozen=True, slots=True)
class BatchWork:
    """One batch of a model, as the projections read it (times in unix seconds, work in
    estimated tokens)."""

    id: str
    tenant: str
    priority: str
    status: str
    deadline: float
    started: float | None  # its first shard's release
    ended: float | None  # when its shards stopped running (finalizing, cancelling, expired)
    total: float
    done: float
    stored_eta: float | None = None
    stored_at_risk: bool = False
    # Its shards that ran within the recent window (see ``recent_shards``), for its own rate.
    shards: tuple[forecast.Span, ...] = ()

    @property
    def remaining(self) -> float:
        return max(0.0, self.total - self.done)

    def queued(self) -> forecast.Queued:
        return forecast.Queued(self.tenant, rank(self.priority), self.deadline, self.remaining)

    def span(self, now: float) -> forecast.Span | None:
        if self.started is None:
            return None
        return forecast.Span(self.started, self.ended if self.ended is not None else now, self.done)


def _ts(value: datetime | None) -> float | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def model_batches(session: Session, model: str, now: datetime, window_s: float) -> list[BatchWork]:
    """The batches of ``model`` that run now or ran within the last ``window_s`` seconds."""
    low = now - timedelta(seconds=window_s)
    done = _committed()
    ended = func.coalesce(Batch.finalizing_at, Batch.cancelling_at, Batch.expired_at)
    rows = session.execute(
        select(
            Batch.id,
            Batch.tenant,
            Batch.priority,
            Batch.status,
            Batch.expires_at,
            ended,
            func.min(Shard.released_at),
            func.sum(Shard.est_tokens),
            func.sum(done),
            Batch.estimated_completion_at,
            Batch.at_risk,
        )
        .join(Shard, Shard.batch_id == Batch.id)
        .where(
            Batch.model == model,
            Batch.in_progress_at.is_not(None),
            # A batch that ended in the window expires after it ended: the index on
            # (status, expires_at) bounds the terminal ones read.
            or_(Batch.status.in_(_RUNNING), and_(Batch.expires_at >= low, ended >= low)),
        )
        .group_by(Batch.id)
    ).all()
    return [
        BatchWork(
            id=r[0],
            tenant=r[1],
            priority=r[2],
            status=r[3],
            deadline=_ts(r[4]) or 0.0,
            started=_ts(r[6]),
            ended=_ts(r[5]) if r[3] != BatchStatus.IN_PROGRESS else None,
            total=float(r[7] or 0),
            done=float(r[8] or 0),
            stored_eta=_ts(r[9]),
            stored_at_risk=bool(r[10]),
        )
        for r in rows
    ]


def _committed():
    """A shard's committed work: its estimated tokens prorated by its committed requests."""
    return case(
        (
            Shard.num_requests > 0,
            cast(Shard.est_tokens, Float) * Shard.done_requests / Shard.num_requests,
        ),
        else_=0.0,
    )


def recent_shards(
    session: Session, batch_ids: list[str], now: datetime, window_s: float
) -> dict[str, list[forecast.Span]]:
    """The released shards of ``batch_ids`` that run now or ended within the last
    ``window_s`` seconds, as spans from their release to their end (the last update of a
    shard that is no longer pending or running) with their committed work."""
    if not batch_ids:
        return {}
    unfinished = Shard.status.in_((ShardStatus.PENDING, ShardStatus.RUNNING))
    rows = session.execute(
        select(Shard.batch_id, Shard.released_at, Shard.updated_at, unfinished, _committed()).where(
            Shard.batch_id.in_(batch_ids),
            Shard.released_at.is_not(None),
            or_(unfinished, Shard.updated_at >= now - timedelta(seconds=window_s)),
        )
    ).all()
    clock = now.timestamp()
    spans: dict[str, list[forecast.Span]] = {}
    for batch_id, released, updated, running, work in rows:
        start = _ts(released) or clock
        end = clock if running else max(start, _ts(updated) or clock)
        spans.setdefault(batch_id, []).append(forecast.Span(start, end, float(work or 0)))
    return spans


def model_rate(batches: list[BatchWork], now: float, window_s: float) -> float | None:
    spans = [s for b in batches if (s := b.span(now)) is not None]
    return forecast.throughput(spans, now=now, window_s=window_s)


def queue_of(batches: list[BatchWork], exclude: str | None = None) -> list[forecast.Queued]:
    """The remaining work of the model's running batches (``exclude`` left out)."""
    return [
        b.queued()
        for b in batches
        if b.status == BatchStatus.IN_PROGRESS and b.id != exclude and b.remaining > 0
    ]


def project_batch(
    batch: BatchWork, batches: list[BatchWork], rate: float | None, now: float, window_s: float
) -> float | None:
    """A running batch's projected finish (unix seconds) or None: at its own rate once it has
    one (``window_s`` bounds its recent window), else from the work ahead of it at the
    model's rate."""
    finish = forecast.from_progress(
        batch.started, batch.done, batch.total, now, batch.shards, max_window_s=window_s
    )
    if finish is not None:
        return finish
    ahead = forecast.work_ahead(
        queue_of(batches, exclude=batch.id),
        tenant=batch.tenant,
        rank=rank(batch.priority),
        deadline=batch.deadline,
        work=batch.remaining,
    )
    projection = forecast.project(ahead, batch.remaining, rate, now)
    return None if projection is None else projection.finish


def refresh(session: Session, now: datetime, window_s: float) -> int:
    """Store every running batch's projected completion and at-risk mark; the number of
    batches whose stored values changed. The caller commits."""
    models = session.scalars(
        select(Batch.model).distinct().where(Batch.status == BatchStatus.IN_PROGRESS)
    ).all()
    clock = now.timestamp()
    changes = []
    for model in models:
        if model is None:  # a batch without a model has no throughput to project
            continue
        batches = model_batches(session, model, now, window_s)
        rate = model_rate(batches, clock, window_s)
        running = [b for b in batches if b.status == BatchStatus.IN_PROGRESS]
        shards = recent_shards(session, [b.id for b in running], now, window_s)
        for batch in running:
            batch = replace(batch, shards=tuple(shards.get(batch.id, ())))
            finish = project_batch(batch, batches, rate, clock, window_s)
            risky = forecast.at_risk(finish, batch.deadline)
            if risky and not batch.stored_at_risk:
                logger.warning(
                    "batch %s is at risk: projected to end %.0f s after its deadline",
                    batch.id,
                    (finish or 0) - batch.deadline,
                )
            unchanged = risky == batch.stored_at_risk and (
                (finish is None and batch.stored_eta is None)
                or (
                    finish is not None
                    and batch.stored_eta is not None
                    and abs(finish - batch.stored_eta) < _MOVE_S
                )
            )
            if not unchanged:
                when = None if finish is None else datetime.fromtimestamp(finish, UTC)
                changes.append({"id": batch.id, "estimated_completion_at": when, "at_risk": risky})
    for change in changes:
        session.execute(
            update(Batch)
            .where(
                Batch.id == change["id"],
                Batch.status == BatchStatus.IN_PROGRESS,
                # A paused batch keeps the projection it had; its reader moves it by the time
                # paused so far (api.schemas).
                Batch.paused_at.is_(None),
            )
            .values(
                estimated_completion_at=change["estimated_completion_at"], at_risk=change["at_risk"]
            )
            .execution_options(synchronize_session=False)
        )
    return len(changes)


@dataclass(frozen=True, slots=True)
class Times:
    """A new batch's projection: the model's rate (estimated tokens/s), the work ahead and,
    when there is a rate, start and finish (unix seconds); ``reason`` says why not."""

    rate: float | None
    ahead: forecast.Ahead
    projection: forecast.Projection | None
    reason: str | None


def times_for_new_batch(
    session: Session,
    model: str,
    *,
    tenant: str,
    priority: str,
    deadline: float,
    work: float,
    now: datetime,
    window_s: float,
) -> Times:
    batches = model_batches(session, model, now, window_s)
    clock = now.timestamp()
    rate = model_rate(batches, clock, window_s)
    ahead = forecast.work_ahead(
        queue_of(batches), tenant=tenant, rank=rank(priority), deadline=deadline, work=work
    )
    projection = forecast.project(ahead, work, rate, clock)
    reason = None
    if projection is None:
        reason = (
            f"No throughput observed for model {model!r} in the last {window_s:g} seconds "
            "(no batch of it has run recently), so no time can be projected yet."
        )
    return Times(rate, ahead, projection, reason)
