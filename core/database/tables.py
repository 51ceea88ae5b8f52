"""The database schema: files, batches, the shards a batch is split into, upstream limits.

Timestamps are stored as timezone-aware datetimes and exposed by the API as unix seconds.
Every status change goes through :mod:`core.database.lifecycle` as one conditional UPDATE.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every database. Postgres stores ``timestamptz``;
    SQLite has no time zones and hands back naive datetimes (written in UTC), which come back
    here marked as UTC, so callers never compare naive with aware values."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def coerce_compared_value(self, op: Any, value: Any) -> Any:
        # Only datetimes are bound as this type; a timedelta in ``column - delta`` is an interval.
        return self if isinstance(value, datetime) else self.impl.coerce_compared_value(op, value)


Timestamp = UTCDateTime()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default="default", index=True)
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)


class ApiKey(Base):
    """A bearer key. Only its SHA-256 is stored; the key itself is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings: "sk-bd-ab12…"
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    last_used_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    # Default webhook for batches created with this key (a batch may name its own).
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    webhook_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # The highest batch priority this key may ask for (high | normal | low).
    max_priority: Mapped[str] = mapped_column(String(8), default="normal", server_default="normal")
    # The shortest completion window this key may ask for, in seconds (None: the server's
    # minimum): like priority, a short window (an early deadline) is an entitlement.
    min_completion_window_s: Mapped[int | None] = mapped_column(Integer, nullable=True)


class UiSession(Base):
    """A dashboard sign-in. The browser's cookie holds a random token; only its SHA-256 is
    stored, with the SHA-256 of the key that signed in, which is checked again (revoked?
    still configured?) on every request."""

    __tablename__ = "ui_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 of the token
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp, index=True)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_status_expires_at", "status", "expires_at"),
        UniqueConstraint("tenant", "idempotency_key", name="uq_batches_tenant_idempotency_key"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default="default", index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # core.database.lifecycle.BatchStatus
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # OpenAI's errors.data: [{code, message, param, line}]
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    # Extensions: scheduling priority (high | normal | low), idempotent create, webhooks.
    priority: Mapped[str] = mapped_column(String(8), default="normal", server_default="normal")
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # A retry made under an idempotency key: what it asked for (parent, include, lines,
    # completion_window, priority), compared when the key comes again.
    retry_request: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    webhook_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # OpenAI's output_expires_after.seconds: the output and error files expire this long after
    # they are created (None: settings.file_expiry_s).
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Prompt tokens counted at validation: what the batch holds against the tenant's queue limit.
    est_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Prompt tokens an earlier line of the batch already holds as a prefix (core.batches.plan):
    # what a prefix cache could serve; planned at validation.
    prefix_shareable_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Its projected completion, refreshed from observed progress while it runs
    # (core.eta.forecast), and whether that projection lies past ``expires_at``.
    estimated_completion_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    at_risk: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    # Validation streams into execution (worker.batches.tasks): the batch is in_progress from its first
    # shard on while the validate task still reads the rest of its input. ``validation_done``
    # turns True when the last shard is planned (until then nothing may finalize it as
    # completed, and its results are not shown); ``validated_at`` is when the validation last
    # made durable progress (a shard created), the clock of the sweep that re-sends a
    # validation that stopped.
    validation_done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    validated_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    # Paused (POST /v1/batches/{id}/pause): since when (None: not paused), and the seconds it
    # was paused before the last resume. Its status stays validating or in_progress.
    paused_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    paused_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # The token budget (prompt plus output tokens, usage's total) its lines may spend; None:
    # none. Lines not started once usage reaches it end as ``budget_exhausted``.
    max_total_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp)
    in_progress_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)

    # request_counts, advanced live as shards checkpoint.
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)
    # usage, summed as shards checkpoint.
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Result lines committed so far, in commit order (core.database.results_log): the next
    # line's seq.
    results_logged: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    shards: Mapped[list[Shard]] = relationship(
        back_populates="batch", order_by="Shard.index", cascade="all, delete-orphan"
    )


class Shard(Base):
    """Input lines run as one Celery task: the range ``[start_line, end_line)``, or those of
    its lines the shard names when the prefix plan cut a window of shards along prefix groups
    (``prepared/NNNNN.lines``, docs/validation.md).

    Results are written to storage in checkpoint chunks; ``done_requests`` counts the shard's
    requests whose results are durably stored, so a retried shard skips them.
    """

    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("batch_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # core.database.lifecycle.ShardStatus
    start_line: Mapped[int] = mapped_column(Integer)  # 1-based, inclusive
    end_line: Mapped[int] = mapped_column(Integer)  # exclusive
    start_offset: Mapped[int] = mapped_column(BigInteger)  # byte offset of start_line
    end_offset: Mapped[int] = mapped_column(BigInteger)
    num_requests: Mapped[int] = mapped_column(Integer)
    est_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    done_requests: Mapped[int] = mapped_column(Integer, default=0)
    num_chunks: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that ended by handing the shard back (a draining worker): not failures.
    handbacks: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    released_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )

    batch: Mapped[Batch] = relationship(back_populates="shards")


class WebhookDelivery(Base):
    """One webhook event for a batch reaching a terminal status, and its delivery attempts."""

    __tablename__ = "webhook_deliveries"
    # The beat sweep's question ("pending, its next attempt overdue") reads only the rows still
    # pending, however many events the table has kept.
    __table_args__ = (
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the event's webhook-id
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    event_type: Mapped[str] = mapped_column(String(32))  # batch.completed, batch.failed, …
    url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # core.database.lifecycle.DeliveryStatus
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    # When the next attempt is due: the event's creation, then (while an attempt runs) its
    # end at the latest, then the retry's time. A pending row overdue by more than
    # webhook_unsent_after_s lost its attempt (a killed worker, a broker or database blip) and
    # the sweep enqueues it again.
    next_attempt_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)


class ResultChunk(Base):
    """One committed checkpoint chunk (or a finalize's ``batch_<code>`` lines) in the batch's
    results log: lines ``[first_seq, first_seq + num_lines)`` in commit order, stored at
    ``storage_key``. See :mod:`core.database.results_log`."""

    __tablename__ = "result_chunks"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    first_seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    num_lines: Mapped[int] = mapped_column(Integer)
    storage_key: Mapped[str] = mapped_column(String(512))


class ResultLine(Base):
    """Where a result line's ``id`` sits in its batch's results log: the cursor of
    ``GET /v1/batches/{id}/results?after=<id>``."""

    __tablename__ = "result_lines"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer)


class UpstreamLimit(Base):
    """The in-flight limit every dispatch worker of one upstream shares, and who sets it: the
    member holding the lease (``leader`` until ``leader_until``) finds the limit from what all
    members report (see :mod:`worker.upstream.shared_limit`)."""

    __tablename__ = "upstream_limits"

    upstream: Mapped[str] = mapped_column(String(255), primary_key=True)
    limit: Mapped[int] = mapped_column(Integer)
    leader: Mapped[str | None] = mapped_column(String(255), nullable=True)
    leader_until: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(Timestamp)


class UpstreamMember(Base):
    """One dispatch worker's report for one upstream: its demand (requests pending and in
    flight) and its cumulative counters, refreshed every second while it runs."""

    __tablename__ = "upstream_members"

    upstream: Mapped[str] = mapped_column(String(255), primary_key=True)
    member: Mapped[str] = mapped_column(String(255), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(Timestamp)
    demand: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_s: Mapped[float] = mapped_column(Float, default=0.0)
    busy_s: Mapped[float] = mapped_column(Float, default=0.0)
    overloads: Mapped[int] = mapped_column(BigInteger, default=0)


class MessageBatch(Base):
    """An Anthropic Message Batch: the batch (``batch_id``) that runs its servable requests,
    and what the Messages API shows beyond it. ``custom_ids`` holds every request's id in the
    order it was sent; ``unservable`` the requests decided ``errored`` at create, as
    ``{position: {"type", "message"}}``; ``counts`` the final request counts, once ended."""

    __tablename__ = "message_batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    batch_id: Mapped[str | None] = mapped_column(
        ForeignKey("batches.id", ondelete="SET NULL"), nullable=True
    )
    custom_ids: Mapped[list[str]] = mapped_column(JSON)
    unservable: Mapped[dict[str, dict[str, str]]] = mapped_column(JSON)
    counts: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp)
    cancel_initiated_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)


class Upload(Base):
    """An OpenAI Upload: a file sent in parts, which becomes an ordinary file on complete."""

    __tablename__ = "uploads"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(128))
    bytes: Mapped[int] = mapped_column(BigInteger)  # as declared at create
    # pending | completing | completed | cancelled | expired
    status: Mapped[str] = mapped_column(String(16), index=True)
    # While completing, the file the complete that holds the claim writes; then the file made.
    file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp, index=True)
    # The parts recorded and their bytes, moved in the same conditional UPDATE that admits a
    # part, so that concurrent parts can never take the upload past its bounds.
    part_count: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    received_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0", default=0)
    # When the complete holding the claim last renewed it (upload_complete_lease_s).
    completing_since: Mapped[datetime | None] = mapped_column(Timestamp, nullable=True)


class UploadPart(Base):
    """One part of an upload, stored as its own object until the upload completes."""

    __tablename__ = "upload_parts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
