"""The service's Prometheus metrics: what the API and the workers count, and the gauges read
from the database at scrape time.

Every metric is ``batchd_*``; label values come from small fixed sets or from configuration and
accounts (a model, a tenant), never a job's id (``tests/core/test_metrics_lint.py`` checks).
Counters count once, in the process where the event happens (docs/core.md);
:class:`ServiceCollector` reads the gauges from the database at each scrape, so they are right
whichever process changed the rows. A model's pending work is defined once, here
(:func:`pending_shards`, :func:`remaining_tokens`): the gauges and the autoscaler's query
(:func:`pending_tokens_sql`, in deploy/kubernetes) read the same rows.

    python -m core.observability.metrics MODEL   # print MODEL's autoscaler query"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement, Select

logger = logging.getLogger(__name__)

# -- API

UPLOAD_BYTES = Counter("batchd_upload_bytes", "Bytes of files uploaded and stored")
UPLOADS = Counter("batchd_uploads", "Files uploaded and stored")
# Reasons: unauthorized (401), not_found (404), payload_too_large (413), rate_limited (429),
# token_limit_exceeded (a batch over the tenant's enqueued-token limit, at validation).
REJECTION_REASONS = {401: "unauthorized", 404: "not_found", 413: "payload_too_large",
                     429: "rate_limited"}  # fmt: skip
REJECTIONS = Counter("batchd_rejections", "Requests and batches refused, by reason", ["reason"])

# -- model workers

REQUESTS_COMPLETED = Counter(
    "batchd_requests_completed",
    "Batch requests that produced an output line (checkpointed)",
    ["model", "tenant"],
)
REQUESTS_FAILED = Counter(
    "batchd_requests_failed",
    "Batch requests that produced an error line while their shard ran (checkpointed)",
    ["model", "tenant"],
)
PROMPT_TOKENS = Counter(
    "batchd_prompt_tokens", "Prompt tokens of completed requests", ["model", "tenant"]
)
CACHED_TOKENS = Counter(
    "batchd_cached_tokens",
    "Prompt tokens of completed requests read from the prefix cache",
    ["model", "tenant"],
)
COMPLETION_TOKENS = Counter(
    "batchd_completion_tokens", "Generated tokens of completed requests", ["model", "tenant"]
)
SHARD_QUEUE_WAIT = Histogram(
    "batchd_shard_queue_wait_seconds",
    "From a shard's release to the broker to its first claim by a worker",
    ["model"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600),
)
ENGINE_LOADS = Counter(
    "batchd_engine_starts",
    "Engines loaded and started by this process (a process restart starts them again)",
    ["model"],
)

# -- control worker

FINALIZE_DURATION = Histogram(
    "batchd_finalize_duration_seconds",
    "Time to merge a batch's shard outputs into its output and error files",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
)
WEBHOOK_DELIVERIES = Counter(
    "batchd_webhook_deliveries", "Webhook delivery attempts, by outcome", ["outcome"]
)
SHARDS_RECLAIMED = Counter(
    "batchd_shards_reclaimed", "Running shards whose worker went silent, re-queued", ["model"]
)


def record_chunk(model: str, tenant: str, pending: Any) -> None:
    """Count one committed checkpoint chunk (a ``worker.shards.state.Pending``)."""
    labels = {"model": model or "", "tenant": tenant or ""}
    if pending.ok:
        REQUESTS_COMPLETED.labels(**labels).inc(pending.ok)
    if pending.failed:
        REQUESTS_FAILED.labels(**labels).inc(pending.failed)
    if pending.input_tokens:
        PROMPT_TOKENS.labels(**labels).inc(pending.input_tokens)
    if pending.cached_tokens:
        CACHED_TOKENS.labels(**labels).inc(pending.cached_tokens)
    if pending.output_tokens:
        COMPLETION_TOKENS.labels(**labels).inc(pending.output_tokens)


# -- a model's pending work


def pending_shards() -> ColumnElement[bool]:
    """The shards that are a model's pending work: those of ``in_progress`` batches that are
    ``pending`` (not released yet, or released to the model's queue) or ``running``."""
    from sqlalchemy import and_

    from core.database.lifecycle import BatchStatus, ShardStatus
    from core.database.tables import Batch, Shard

    return and_(
        Batch.status == BatchStatus.IN_PROGRESS,
        Shard.status.in_((ShardStatus.PENDING, ShardStatus.RUNNING)),
    )


def remaining_tokens() -> ColumnElement[Any]:
    """A shard's estimated prompt + output tokens still to do: its estimate, less the share of
    its requests whose results are committed."""
    from sqlalchemy import case

    from core.database.tables import Shard

    left = Shard.est_tokens * (Shard.num_requests - Shard.done_requests) / Shard.num_requests
    return case((Shard.num_requests > 0, left), else_=0)


def pending_tokens_query(model: str) -> Select[int]:
    """One row, one column: ``model``'s pending tokens (the sum of ``batchd_pending_tokens``
    over its states), rounded up to a whole token, 0 when nothing waits."""
    from sqlalchemy import BigInteger, cast, func, select

    from core.database.tables import Batch, Shard

    total = func.ceil(func.coalesce(func.sum(remaining_tokens()), 0))
    return (
        select(cast(total, BigInteger).label("pending_tokens"))
        .select_from(Shard)
        .join(Batch, Batch.id == Shard.batch_id)
        .where(pending_shards(), Batch.model == model)
    )


def pending_tokens_sql(model: str) -> str:
    """:func:`pending_tokens_query` as PostgreSQL text with ``model`` written in (quoted): the
    query of KEDA's PostgreSQL scaler, which takes no parameters, in each model's
    ScaledObject (deploy/kubernetes; tests/test_kubernetes.py compares them)."""
    from sqlalchemy.dialects import postgresql

    compiled = pending_tokens_query(model).compile(
        dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
    )
    return "\n".join(line.rstrip() for line in str(compiled).splitlines())


# -- gauges read from the database


class ServiceCollector(Collector):
    """Batches by status, shards by model and status, and each model's pending work: shards
    not released yet, released (in the broker or about to be), and running, with their
    estimated tokens (a running shard counts the share of its estimate still to do). The
    broker queue is bounded on purpose (``max_released_shards_per_model``), so an autoscaler
    (KEDA's Prometheus scaler, say) should scale on ``batchd_pending_tokens``, not on the
    queue length."""

    STATES = ("unreleased", "released", "running")

    def __init__(self, database_url: str | None = None, models: list[str] | None = None) -> None:
        self.database_url = database_url
        self.models = list(models or ())  # reported as 0 when they have no work (not absent)

    def collect(self) -> Iterator[Any]:
        from sqlalchemy import case, func, select

        from core.database.sessions import session_scope
        from core.database.tables import Batch, Shard

        batches = GaugeMetricFamily("batchd_batches", "Batches by status", labels=["status"])
        shards = GaugeMetricFamily(
            "batchd_shards", "Shards of unfinished batches by model and status",
            labels=["model", "status"],
        )  # fmt: skip
        pending = GaugeMetricFamily(
            "batchd_pending_shards",
            "Shards waiting or running per model: unreleased (in Postgres), released (sent to "
            "the model's queue), running",
            labels=["model", "state"],
        )
        tokens = GaugeMetricFamily(
            "batchd_pending_tokens",
            "Estimated prompt + output tokens of the pending shards (see batchd_pending_shards)",
            labels=["model", "state"],
        )
        at_risk = GaugeMetricFamily(
            "batchd_batches_at_risk",
            "Running batches projected to end after their deadline (core.eta.store)",
            labels=["model"],
        )
        up = GaugeMetricFamily("batchd_database_up", "1 if the last scrape read the database")
        try:
            with session_scope(self.database_url) as session:
                if session.get_bind().dialect.name == "postgresql":
                    # One snapshot for every gauge: a batch moving on between two of the
                    # statements below would otherwise be counted twice or not at all.
                    session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
                by_status = session.execute(
                    select(Batch.status, func.count()).group_by(Batch.status)
                ).all()
                state = case(
                    (Shard.status == "running", "running"),
                    (Shard.released_at.is_(None), "unreleased"),
                    else_="released",
                )
                unfinished = Batch.status.in_(("validating", "in_progress", "finalizing",
                                               "cancelling"))  # fmt: skip
                by_shard = session.execute(
                    select(Batch.model, Shard.status, func.count())
                    .join(Batch, Batch.id == Shard.batch_id)
                    .where(unfinished)
                    .group_by(Batch.model, Shard.status)
                ).all()
                risky = session.execute(
                    select(Batch.model, func.count())
                    .where(Batch.status == "in_progress", Batch.at_risk.is_(True))
                    .group_by(Batch.model)
                ).all()
                work = session.execute(
                    select(Batch.model, state, func.count(), func.sum(remaining_tokens()))
                    .join(Batch, Batch.id == Shard.batch_id)
                    .where(pending_shards())
                    .group_by(Batch.model, state)
                ).all()
        except Exception as exc:  # a database outage: say so in batchd_database_up
            logger.warning("reading the service gauges failed: %r", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        for status, n in by_status:
            batches.add_metric([status], n)
        for model, status, n in by_shard:
            shards.add_metric([model or "", status], n)
        found = {(model or "", st): (n, float(est or 0)) for model, st, n, est in work}
        for model in self.models:
            for st in self.STATES:
                found.setdefault((model, st), (0, 0.0))
        for (model, st), (n, est) in sorted(found.items()):
            pending.add_metric([model, st], n)
            tokens.add_metric([model, st], est)
        risky_by_model = {model or "": n for model, n in risky}
        for model in sorted(set(self.models) | set(risky_by_model)):
            at_risk.add_metric([model], risky_by_model.get(model, 0))
        yield from (up, batches, shards, pending, tokens, at_risk)


def observe_queue_wait(model: str, released_at: Any) -> None:
    """A shard's first claim: the time since its release (``released_at``, aware or UTC)."""
    from datetime import UTC, datetime

    if released_at.tzinfo is None:
        released_at = released_at.replace(tzinfo=UTC)
    wait = (datetime.now(UTC) - released_at).total_seconds()
    SHARD_QUEUE_WAIT.labels(model=model or "").observe(max(0.0, wait))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(
            "usage: python -m core.observability.metrics MODEL  (prints its autoscaler query)"
        )
    print(pending_tokens_sql(sys.argv[1]))
