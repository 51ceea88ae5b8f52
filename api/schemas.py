"""OpenAI-shaped request and response bodies, one schema per direction (create / public).

Field names and types follow the official ``openai`` package's types so its client parses every
answer; ORM rows never leave the API directly.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator

from api.errors import invalid_request
from core.batches.completion_windows import WINDOW, window_seconds
from core.batches.priority import PriorityName, priority_name
from core.batches.retry import MAX_LINE_ITEMS
from core.database.auth import MAX_WEBHOOK_URL_CHARS, is_text, webhook_url_problem
from core.database.lifecycle import PAUSABLE, BatchStatus, now
from core.database.tables import Batch, File

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

BatchEndpoint = Literal[
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"
]
BatchPriority = PriorityName
MAX_IDEMPOTENCY_KEY_CHARS = 256
#: Printable ASCII: what survives any HTTP header and any database. Checked in the route.
IDEMPOTENCY_KEY_PATTERN = "^[ -~]+$"


def unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


# ---- errors ----------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ---- files -----------------------------------------------------------------------------------


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str = Field(description='"batch" for uploads, "batch_output" for results.')
    expires_at: int | None = None
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> FilePublic:
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=unix(row.created_at) or 0,
            filename=row.filename,
            purpose=row.purpose,
            expires_at=unix(row.expires_at),
        )


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FilePublic]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---- batches ---------------------------------------------------------------------------------


#: The lifetime a client may give a file (OpenAI's ``expires_after``/``output_expires_after``).
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600


class ExpiresAfter(BaseModel):
    """``{"anchor": "created_at", "seconds": 3600..2592000}``. The schema documents the range
    and the anchor; :meth:`checked_seconds` enforces them with OpenAI's messages."""

    model_config = ConfigDict(extra="forbid")

    anchor: str = Field(json_schema_extra={"enum": ["created_at"]})
    seconds: int = Field(json_schema_extra={"minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S})

    def checked_seconds(self, param: str) -> int:
        """The lifetime in seconds; :class:`APIError` 400 naming ``param``'s field otherwise."""
        if self.anchor != "created_at":
            raise invalid_request(
                f"Invalid value: {self.anchor[:64]!r}. Supported values are: 'created_at'.",
                param=f"{param}.anchor",
            )
        if self.seconds < MIN_EXPIRY_S:
            raise invalid_request(
                f"Invalid '{param}.seconds': integer below minimum value. Expected a value "
                f">= {MIN_EXPIRY_S}, but got {self.seconds} instead.",
                param=f"{param}.seconds",
            )
        if self.seconds > MAX_EXPIRY_S:
            raise invalid_request(
                f"Invalid '{param}.seconds': integer above maximum value. Expected a value "
                f"<= {MAX_EXPIRY_S}, but got {self.seconds} instead.",
                param=f"{param}.seconds",
            )
        return self.seconds


class BatchCreate(BaseModel):
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: BatchEndpoint
    completion_window: str = Field(
        description='"24h", or "<n>s", "<n>m", "<n>h", "<n>d" (e.g. "1h" to "7d") within '
        "the server's and the API key's limits.",
        min_length=2,
        max_length=16,
        # Documented, and checked by the validator below with a clearer message.
        json_schema_extra={"pattern": WINDOW.pattern},
    )
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Up to 16 pairs; keys up to 64 characters, values up to 512.",
    )
    output_expires_after: ExpiresAfter | None = None
    # Extensions (OpenAI clients send them with ``extra_body``).
    priority: BatchPriority = Field(
        default="normal", description="Scheduling priority among this server's batches."
    )
    webhook_url: str | None = Field(
        default=None,
        description="An http(s) URL notified when the batch finishes; defaults to the API "
        "key's webhook URL. Deliveries are signed with the key's webhook secret.",
        max_length=MAX_WEBHOOK_URL_CHARS,
        json_schema_extra={"format": "uri", "pattern": "^[Hh][Tt][Tt][Pp][Ss]?://[^/?#]"},
    )
    max_total_tokens: int | None = Field(
        default=None,
        ge=1,
        description="A token budget: the prompt plus output tokens the batch's lines may "
        "spend (usage.total_tokens). Refused when the prompts alone exceed it; once spent, "
        "lines not yet started end as 'budget_exhausted' errors.",
    )
    idempotency_key: str | None = Field(
        default=None,
        description="Like the Idempotency-Key header: a repeated create with the same key "
        "returns the batch the first one created.",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        json_schema_extra={"pattern": IDEMPOTENCY_KEY_PATTERN},
    )

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        if value is not None and (problem := webhook_url_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("completion_window")
    @classmethod
    def _window_shape(cls, value: str) -> str:
        if window_seconds(value) is None:
            raise ValueError('expected "24h" or a duration like "1h", "90m", "7d"')
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(
                f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed, got {len(value)}"
            )
        for key, item in value.items():
            if not is_text(key) or not is_text(item):
                raise ValueError("keys and values must be valid Unicode text")
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(
                    f"key {key[:16]!r}... is {len(key)} characters; the maximum is "
                    f"{MAX_METADATA_KEY_CHARS}"
                )
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"the value of {key!r} is {len(item)} characters; the maximum is "
                    f"{MAX_METADATA_VALUE_CHARS}"
                )
        return value


class BatchErrorItem(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class PrefixCache(BaseModel):
    """What the batch's prefix plan saved (docs/api.md#prefix-cache)."""

    prompt_tokens: int = Field(description="Prompt tokens of the lines run so far.")
    cached_tokens: int = Field(
        description="Of those, the tokens the engine served from its prefix cache."
    )
    predicted_shareable_tokens: int = Field(
        description="Prompt tokens that an earlier line of the batch holds as a prefix, counted "
        "at validation: what a prefix cache large enough could serve."
    )


class BatchPublic(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: BatchUsage
    prefix_cache: PrefixCache | None = Field(
        default=None, description="An extension: what the batch's prefix plan saved."
    )
    # Extensions; OpenAI's client keeps unknown fields.
    priority: BatchPriority = "normal"
    webhook_url: str | None = None
    estimated_completion_at: int | None = Field(
        default=None,
        description="While validating or in progress: when the batch is projected to end, "
        "from its observed progress (null until there is data).",
    )
    at_risk: bool | None = Field(
        default=None,
        description="While validating or in progress: whether its projected end is after "
        "its deadline (expires_at).",
    )
    paused: bool = Field(
        default=False,
        description="Whether the batch is paused (POST /v1/batches/{id}/pause); its status "
        "stays validating or in_progress.",
    )
    paused_at: int | None = Field(default=None, description="When the pause began.")
    max_total_tokens: int | None = Field(
        default=None,
        description="Its token budget (prompt plus output tokens); usage.total_tokens is "
        "what it spent.",
    )
    webhook_secret: str | None = Field(
        default=None,
        description="Only in the answer to the create that made the batch, and only when the "
        "batch has a webhook but the API key has no webhook secret: the secret generated for "
        "this batch's deliveries.",
    )

    @classmethod
    def of(cls, row: Batch, *, show_secret: bool = False) -> BatchPublic:
        errors = None
        if row.errors:
            errors = BatchErrors(data=[BatchErrorItem(**_error_fields(e)) for e in row.errors])
        input_tokens = row.input_tokens or 0
        output_tokens = row.output_tokens or 0
        return cls(
            id=row.id,
            endpoint=row.endpoint,
            model=row.model,
            errors=errors,
            input_file_id=row.input_file_id,
            completion_window=row.completion_window,
            status=row.status,  # type: ignore[arg-type]
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            created_at=unix(row.created_at) or 0,
            in_progress_at=unix(row.in_progress_at),
            expires_at=unix(row.expires_at),
            finalizing_at=unix(row.finalizing_at),
            completed_at=unix(row.completed_at),
            failed_at=unix(row.failed_at),
            expired_at=unix(row.expired_at),
            cancelling_at=unix(row.cancelling_at),
            cancelled_at=unix(row.cancelled_at),
            request_counts=RequestCounts(
                total=row.request_total or 0,
                completed=row.request_completed or 0,
                failed=row.request_failed or 0,
            ),
            metadata=row.metadata_,
            usage=BatchUsage(
                input_tokens=input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=row.cached_tokens or 0),
                output_tokens=output_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                total_tokens=input_tokens + output_tokens,
            ),
            priority=priority_name(row.priority),
            webhook_url=row.webhook_url,
            webhook_secret=row.webhook_secret if show_secret else None,
            prefix_cache=PrefixCache(
                prompt_tokens=input_tokens,
                cached_tokens=row.cached_tokens or 0,
                predicted_shareable_tokens=row.prefix_shareable_tokens or 0,
            ),
            max_total_tokens=row.max_total_tokens,
            **_pause(row),
            **_projection(row),
        )


def _paused(row: Batch) -> bool:
    return row.paused_at is not None and row.status in PAUSABLE


def _pause(row: Batch) -> dict[str, Any]:
    """``paused`` and ``paused_at`` while a paused batch may still run."""
    if not _paused(row):
        return {}
    return {"paused": True, "paused_at": unix(row.paused_at)}


def _projection(row: Batch) -> dict[str, Any]:
    """``estimated_completion_at`` and ``at_risk`` while the batch may still run. A paused
    batch's projection is the one it had when paused, later by the time paused so far (its
    window's clock runs on), and at risk once that passes ``expires_at``."""
    if row.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        return {}
    eta = row.estimated_completion_at
    at_risk = bool(row.at_risk)
    if eta is not None and row.paused_at is not None:
        eta = eta + (now() - row.paused_at)
        at_risk = at_risk or eta > row.expires_at
    # Rounded up, where the other times are rounded down: a projection past the deadline by
    # less than a second still reads as past ``expires_at`` when it is marked at risk.
    return {
        "estimated_completion_at": None if eta is None else math.ceil(eta.timestamp()),
        "at_risk": at_risk,
    }


def _error_fields(entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict):
        return {"message": str(entry)}
    line = entry.get("line")
    return {
        "code": None if entry.get("code") is None else str(entry["code"]),
        "message": None if entry.get("message") is None else str(entry["message"]),
        "param": None if entry.get("param") is None else str(entry["param"]),
        "line": line if isinstance(line, int) else None,
    }


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchPublic]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# ---- batchd extensions: results so far, retry, estimate ----------------------------------------


class ResultPage(BaseModel):
    """Result lines in the order they were committed, each exactly as it appears (or will) in
    the batch's output or error file."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


RetryKind = Literal["expired", "cancelled", "budget_exhausted", "failed"]


def _line_number(item: Any) -> int | None:
    """``item`` as a line number (JSON's integers, 3.0 included), or None."""
    if isinstance(item, float) and item.is_integer():
        item = int(item)
    return item if isinstance(item, int) and not isinstance(item, bool) and item >= 1 else None


def _line_item(value: Any) -> int | tuple[int, int]:
    if (number := _line_number(value)) is not None:
        return number
    if isinstance(value, list | tuple) and len(value) == 2:
        first, last = _line_number(value[0]), _line_number(value[1])
        if first is not None and last is not None:
            # A range that ends before it starts is refused by the retry (400, param
            # "lines"): a schema cannot say so.
            return (first, last)
    raise ValueError(
        "expected a line number (an integer, 1 or more) or a range [first, last] of them"
    )


LineNumber = {"type": "integer", "minimum": 1}
#: One item of a retry's ``lines``: a 1-based line number, or an inclusive range of them.
LineItem = Annotated[
    Any,
    PlainValidator(_line_item),
    WithJsonSchema(
        {
            "oneOf": [
                LineNumber,
                {"type": "array", "items": LineNumber, "minItems": 2, "maxItems": 2},
            ]
        }
    ),
]


class RetryCreate(BaseModel):
    """What to retry, and how to run it (by default as the parent ran)."""

    model_config = ConfigDict(extra="forbid")

    include: list[RetryKind] | None = Field(
        default=None,
        min_length=1,
        description="Which lines to retry: 'expired', 'cancelled', 'budget_exhausted' "
        "(never ran) and 'failed' "
        "(failed with a retryable error: 5xx or 429; a request's own 4xx error never is). "
        "Default: all four.",
    )
    completion_window: str | None = Field(
        default=None,
        description="Default: the parent's completion window.",
        min_length=2,
        max_length=16,
        # Documented, and checked by the validator below with a clearer message.
        json_schema_extra={"pattern": WINDOW.pattern},
    )
    priority: BatchPriority | None = Field(
        default=None, description="Default: the parent's priority (if this key may use it)."
    )
    max_total_tokens: int | None = Field(
        default=None,
        ge=1,
        description="The retry's own token budget (see the create's); default: none.",
    )
    lines: list[LineItem] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_LINE_ITEMS,
        description="Narrow the retry to these lines of the parent's input file: 1-based line "
        "numbers (as validation errors name them) and inclusive ranges [first, last], e.g. "
        "[3, [10, 20]]. Of them, the lines whose results are of the kinds in 'include' are "
        "retried. A number past the file's last line is a 400 naming it; so is a number on "
        "its own that names a blank line or a line a retry cannot read.",
    )

    @field_validator("completion_window")
    @classmethod
    def _window_shape(cls, value: str | None) -> str | None:
        if value is not None and window_seconds(value) is None:
            raise ValueError('expected "24h" or a duration like "1h", "90m", "7d"')
        return value


class ModelEstimate(BaseModel):
    requests: int
    prompt_tokens: int
    max_completion_tokens: int
    throughput_tokens_per_s: float | None = Field(
        default=None,
        description="Estimated tokens (prompt + output bound) per second the model's batches "
        "retired over the recent window; null when none ran.",
    )


class BatchEstimate(BaseModel):
    object: Literal["batch.estimate"] = "batch.estimate"
    endpoint: str
    completion_window: str
    priority: BatchPriority
    model: str | None = None
    total_requests: int
    valid_requests: int
    errors: list[BatchErrorItem] = Field(
        description="The line errors a create would fail with (the first 100, as validation "
        "reports them); empty when the file is valid."
    )
    prompt_tokens: int = Field(description="Exact, by the model's tokenizer.")
    max_completion_tokens: int = Field(description="The sum of the requests' output bounds.")
    predicted_shareable_tokens: int = Field(
        default=0,
        description="Prompt tokens that an earlier line holds as a prefix: what the prefix plan "
        "predicts a prefix cache can serve (docs/validation.md#the-prefix-plan).",
    )
    per_model: dict[str, ModelEstimate]
    queue_ahead_tokens: int = Field(
        description="Estimated tokens that run before or beside this batch until it ends: "
        "higher priorities, this tenant's batches with earlier deadlines, and other tenants' "
        "fair share at the same priority."
    )
    estimated_start_at: int | None = None
    estimated_completion_at: int | None = None
    expires_at: int = Field(description="The deadline a batch created now would get.")
    fits_window: bool | None = Field(
        default=None, description="estimated_completion_at <= expires_at; null without times."
    )
    reason: str | None = Field(default=None, description="Why the times are null.")


# ---- models ----------------------------------------------------------------------------------


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchd"
    # As vLLM lists them: a LoRA adapter's ``parent`` is its base model and its ``root`` the
    # adapter (its directory, or the name its upstream serves it under); a model's ``parent``
    # is null and its ``root`` its own id.
    root: str | None = None
    parent: str | None = None
    # Extensions: what the model does, and the batch endpoints it serves.
    kind: Literal["generate", "embedding"] = "generate"
    endpoints: list[str] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
