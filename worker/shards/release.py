"""Shard release: a bounded, fair window of each model's shards on the broker.

At most ``max_released_shards_per_model`` shards of a model are released and unfinished at
once; :func:`choose` picks the next by the engine host's own rules (``engine.host.order``):
tier (with aging), tenant and batch sharing by tokens (the tokens each holds released and
unfinished, read from the database) and batch deadline. Callers race
freely: a per-model lock serializes the choice and a conditional UPDATE releases a shard once;
messages go after the commit. Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery.signals import task_postrun
from sqlalchemy import and_, func, select, text, update
from sqlalchemy.orm import Session

from core.batches.priority import Priority
from core.broker.queue import TASK_RELEASE_SWEEP, TASK_RUN_SHARD, model_queue
from core.database.lifecycle import BatchStatus, ShardStatus, now
from core.database.sessions import session_scope, updated
from core.database.tables import Batch, Shard
from core.settings import get_settings
from engine.host.order import NEVER, aged_tier, flow_key, share_key
from worker.infra import app, retrying, send

logger = logging.getLogger(__name__)

_local_lock = threading.Lock()  # SQLite: one releaser per process at a time


def resend_after_s() -> float:
    """A shard released this long ago and still pending is sent again by the sweep."""
    settings = get_settings()
    return settings.release_resend_after_s or max(600.0, 10 * settings.shard_stale_after_s)


def _lock_key(model: str) -> int:
    digest = hashlib.sha256(f"batchd.release:{model}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _lock_model(session: Session, model: str) -> None:
    """Serialize the releasers of ``model`` until this transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_key(model)})
    else:
        # SQLite: an UPDATE (even of no row) takes the database's write lock until commit.
        session.execute(text("UPDATE shards SET released_at = released_at WHERE 1 = 0"))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pending, unreleased shard that may be released now (its batch's head or near it)."""

    shard_id: int
    index: int
    batch_id: str
    tenant: str
    priority: str
    created_at: datetime
    cost: int = 1  # the shard's estimated tokens (at least 1)
    started_at: datetime | None = None  # when its batch's shards became pending (in_progress)
    deadline: datetime | None = None  # its batch's expires_at (None: no deadline, last)


@dataclass
class Load:
    """What a model's shards hold now: released-and-unfinished shards in total, their tokens
    per tenant and per batch, and when each tenant and batch last had a shard released (unix
    seconds)."""

    total: int = 0
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    batch_tokens: dict[str, int] = field(default_factory=dict)
    tenant_last: dict[str, float] = field(default_factory=dict)
    batch_last: dict[str, float] = field(default_factory=dict)


def shard_cost(est_tokens: int | None) -> int:
    """A shard's cost in the release's token share: its estimated tokens, at least 1."""
    return max(1, int(est_tokens or 0))


def _load(session: Session, model: str) -> Load:
    load = Load(tenant_tokens=defaultdict(int), batch_tokens=defaultdict(int))
    rows = session.execute(
        select(Batch.tenant, Shard.batch_id, func.count(), func.sum(Shard.est_tokens))
        .select_from(Shard)
        .join(Batch, Batch.id == Shard.batch_id)
        .where(
            Batch.model == model,
            Shard.released_at.is_not(None),
            Shard.status.in_((ShardStatus.PENDING, ShardStatus.RUNNING)),
        )
        .group_by(Batch.tenant, Shard.batch_id)
    ).all()
    for tenant, batch_id, n, tokens in rows:
        # Each shard costs at least 1 (shard_cost), as when it was chosen.
        cost = max(int(tokens or 0), n)
        load.tenant_tokens[tenant] += cost
        load.batch_tokens[batch_id] += cost
        load.total += n
    last = session.execute(
        select(Batch.tenant, Shard.batch_id, func.max(Shard.released_at))
        .select_from(Shard)
        .join(Batch, Batch.id == Shard.batch_id)
        .where(
            Batch.model == model,
            Batch.status.in_((BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)),
            Shard.released_at.is_not(None),
        )
        .group_by(Batch.tenant, Shard.batch_id)
    ).all()
    for tenant, batch_id, when in last:
        if when is None:  # not so (the WHERE); the column is nullable
            continue
        ts = _ts(when)
        load.batch_last[batch_id] = ts
        load.tenant_last[tenant] = max(ts, load.tenant_last.get(tenant, ts))
    return load


def _ts(value: datetime) -> float:
    return value.timestamp()


def _candidates(session: Session, model: str, per_batch_limit: int) -> list[Candidate]:
    """The first ``per_batch_limit`` unreleased pending shards of each runnable batch."""
    ranked = (
        select(
            Shard.id.label("shard_id"),
            Shard.index.label("shard_index"),
            Shard.batch_id.label("batch_id"),
            Shard.est_tokens.label("est_tokens"),
            func.row_number().over(partition_by=Shard.batch_id, order_by=Shard.index).label("rn"),
        )
        .join(Batch, Batch.id == Shard.batch_id)
        .where(
            Batch.model == model,
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.paused_at.is_(None),  # a paused batch's capacity goes to the others
            Batch.expires_at > now(),
            Shard.status == ShardStatus.PENDING,
            Shard.released_at.is_(None),
        )
        .subquery()
    )
    rows = session.execute(
        select(
            ranked.c.shard_id,
            ranked.c.shard_index,
            ranked.c.batch_id,
            Batch.tenant,
            Batch.priority,
            Batch.created_at,
            ranked.c.est_tokens,
            Batch.in_progress_at,
            Batch.expires_at,
        )
        .join(Batch, Batch.id == ranked.c.batch_id)
        .where(ranked.c.rn <= per_batch_limit)
    ).all()
    return [
        Candidate(
            shard_id=r.shard_id,
            index=r.shard_index,
            batch_id=r.batch_id,
            tenant=r.tenant,
            priority=r.priority,
            created_at=r.created_at,
            cost=shard_cost(r.est_tokens),
            started_at=r.in_progress_at,
            deadline=r.expires_at,
        )
        for r in rows
    ]


def tier(cand: Candidate, last_release: float | None, aging_s: float | None, clock: float) -> int:
    """The tier ``cand`` competes in, as the engine numbers tiers (lower first): its batch's
    priority, except that a ``low`` batch waiting longer than ``aging_s`` since its last
    release (or, before any, since it started running) competes as ``normal``
    (``engine.host.order.aged_tier``)."""
    since = _ts(cand.started_at or cand.created_at)
    if last_release is not None:
        since = max(since, last_release)
    return aged_tier(Priority.parse(cand.priority).engine, since, clock, aging_s)


def choose(
    candidates: list[Candidate],
    slots: int,
    load: Load,
    *,
    aging_s: float | None = None,
    clock: float | None = None,
) -> list[Candidate]:
    """Pick up to ``slots`` shards in release order, ``engine.host.order.flow_key``: the most
    urgent tier first (``low`` aged into ``normal`` after ``aging_s``); in it, the tenant
    holding the fewest released tokens, and among equals the one served longest ago; in the
    tenant, the batch with the earliest deadline, then the same as for tenants; then the
    oldest batch, and a batch's shards in index order. ``clock`` is the current unix time. A
    pure function: it reads only its arguments."""
    tenant_tokens = defaultdict(int, load.tenant_tokens)
    batch_tokens = defaultdict(int, load.batch_tokens)
    tenant_last = dict(load.tenant_last)
    batch_last = dict(load.batch_last)
    current = time.time() if clock is None else clock
    # Release stamps of this call: after every earlier release, in pick order.
    stamp = max([current, *tenant_last.values(), *batch_last.values()])
    # Each batch's shards in index order; only a batch's head is ever a choice.
    queues: dict[str, list[Candidate]] = defaultdict(list)
    for cand in sorted(candidates, key=lambda c: c.index):
        queues[cand.batch_id].append(cand)
    chosen: list[Candidate] = []
    while len(chosen) < slots and queues:

        def order(c: Candidate) -> tuple:
            rank = tier(c, batch_last.get(c.batch_id), aging_s, current)
            aged = rank < Priority.parse(c.priority).engine
            # An aged low batch goes first in its tenant: aging bounds its wait, and an earlier
            # deadline of the tenant's normal work must not undo that.
            key = flow_key(
                rank,
                share_key(tenant_tokens[c.tenant], tenant_last.get(c.tenant, NEVER)),
                _ts(c.deadline) if c.deadline else None,
                aged,
                share_key(batch_tokens[c.batch_id], batch_last.get(c.batch_id, NEVER)),
            )
            return (*key, _ts(c.created_at), c.batch_id, c.index)

        head = min((q[0] for q in queues.values()), key=order)
        chosen.append(head)
        stamp += 1e-3
        tenant_tokens[head.tenant] += head.cost
        batch_tokens[head.batch_id] += head.cost
        tenant_last[head.tenant] = batch_last[head.batch_id] = stamp
        queue = queues[head.batch_id]
        queue.pop(0)
        if not queue:
            del queues[head.batch_id]
    return chosen


def _release(model: str, limit: int) -> list[int]:
    with session_scope() as session:
        _lock_model(session, model)
        load = _load(session, model)
        slots = limit - load.total
        if slots <= 0:
            return []
        picks = choose(
            _candidates(session, model, slots),
            slots,
            load,
            aging_s=get_settings().low_priority_aging_s,
            clock=_ts(now()),
        )
        if not picks:
            return []
        # One UPDATE per pick, each stamped a microsecond apart, so ``released_at`` records the
        # release order (the next choice's "served longest ago" reads it).
        base = now()
        released = []
        for k, pick in enumerate(picks):
            won = updated(
                session,
                update(Shard)
                .where(
                    Shard.id == pick.shard_id,
                    Shard.status == ShardStatus.PENDING,
                    Shard.released_at.is_(None),
                )
                .values(released_at=base + timedelta(microseconds=k))
                .execution_options(synchronize_session=False),
            )
            if won == 1:
                released.append(pick.shard_id)
        return released


def _unrelease(shard_ids: list[int]) -> None:
    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.id.in_(shard_ids), Shard.status == ShardStatus.PENDING)
            .values(released_at=None)
            .execution_options(synchronize_session=False)
        )


def release_next(model: str | None) -> None:
    """A shard of ``model`` ended: send the next pending ones its release allows. A failure is
    logged, never raised: the release sweep sends what this missed."""
    if not model:
        return
    try:
        retrying(lambda: release_for_model(model), f"releasing shards of {model}")
    except Exception:
        logger.exception("releasing the next shards of %s failed", model)


def release_for_model(model: str | None) -> int:
    """Send the next pending shards of ``model`` to its queue, up to the bound; return how
    many were sent. Safe to call from any number of processes and threads at once."""
    if not model:
        return 0
    limit = get_settings().max_released_shards_per_model
    sqlite = get_settings().uses_embedded_defaults
    if sqlite:
        _local_lock.acquire()
    try:
        shard_ids = _release(model, limit)
    finally:
        if sqlite:
            _local_lock.release()
    sent: list[int] = []
    try:
        for shard_id in shard_ids:
            send(TASK_RUN_SHARD, shard_id, queue=model_queue(model))
            sent.append(shard_id)
    except Exception:
        unsent = [s for s in shard_ids if s not in set(sent)]
        logger.exception(
            "could not send %s released shards of %s; un-releasing", len(unsent), model
        )
        try:
            _unrelease(unsent)
        except Exception:
            logger.exception("could not un-release shards %s (the sweep re-sends them)", unsent)
    if sent:
        logger.info("released %s shards of %s: %s", len(sent), model, sent)
    return len(sent)


def release_for_batch(batch_id: str) -> int:
    """:func:`release_for_model` for the model of ``batch_id``."""
    with session_scope() as session:
        model = session.scalar(select(Batch.model).where(Batch.id == batch_id))
    return release_for_model(model)


def _resend_lost(model: str) -> int:
    """Re-send shards released long ago that no worker has claimed (see module docstring)."""
    cutoff = now() - timedelta(seconds=resend_after_s())
    with session_scope() as session:
        stale = session.scalars(
            update(Shard)
            .where(
                Shard.status == ShardStatus.PENDING,
                Shard.attempts == 0,  # never claimed; a reclaimed shard is recovery's to re-send
                Shard.released_at.is_not(None),
                Shard.released_at < cutoff,
                Shard.updated_at < cutoff,
                Shard.batch_id.in_(
                    select(Batch.id).where(
                        and_(
                            Batch.model == model,
                            Batch.status == BatchStatus.IN_PROGRESS,
                            Batch.paused_at.is_(None),
                        )
                    )
                ),
            )
            .values(released_at=now())
            .returning(Shard.id)
            .execution_options(synchronize_session=False)
        ).all()
    for shard_id in stale:
        logger.warning("shard %s was released but never started; sending it again", shard_id)
        send(TASK_RUN_SHARD, shard_id, queue=model_queue(model))
    return len(stale)


def sweep() -> int:
    """Release for every model that has runnable pending shards; re-send lost releases."""
    with session_scope() as session:
        models = {
            model
            for model in session.scalars(
                select(Batch.model).distinct().where(Batch.status == BatchStatus.IN_PROGRESS)
            )
            if model is not None
        }
    sent = 0
    for model in sorted(models):
        try:
            sent += _resend_lost(model)
            sent += release_for_model(model)
        except Exception:
            logger.exception("release sweep failed for model %s", model)
    return sent


@app.task(name=TASK_RELEASE_SWEEP)
def release_sweep_task(**_: Any) -> None:
    sweep()


@task_postrun.connect
def _release_after_shard(sender: Any = None, args: Any = None, **_: Any) -> None:
    """A shard task ended (done, stopped, lost or failed): its slot may be free."""
    if getattr(sender, "name", None) != TASK_RUN_SHARD or not args:
        return
    try:
        with session_scope() as session:
            model = session.scalar(
                select(Batch.model)
                .join(Shard, Shard.batch_id == Batch.id)
                .where(Shard.id == int(args[0]))
            )
        release_for_model(model)
    except Exception:
        logger.exception("release after shard %s failed (the sweep retries)", args[0])
