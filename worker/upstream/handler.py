"""How a shard's lines run on an upstream model: the body as the user wrote it, only ``model``
rewritten and the tenant's prefix-cache salt set (:mod:`worker.upstream.cache_salt`), sent by
the process's :class:`~worker.upstream.dispatcher.Dispatcher`; the server's answer becomes the
output line (its body as it came) or an error line with the server's status and message (any
key it quotes redacted)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from core.batches.priority import Priority
from core.batchfile.request import BatchRequest
from core.batchfile.results import ChoiceResult, GenerationResult, output_line, request_error_line
from core.database.tables import Batch
from core.llms import generation
from core.llms.generation import error_for_exception
from core.llms.specs import UpstreamSpec
from core.security.redaction import redact
from core.settings import get_settings
from worker.handler import SUBMIT_WAIT_S, Aborted, Line, RequestOutcome
from worker.upstream.cache_salt import salt_key, salted_body
from worker.upstream.dispatcher import Dispatcher, Reply

PREFIX_CHARS = 512  # lines whose prompts agree this far are sent together


def prompt_prefix(body: dict[str, Any]) -> str:
    """The start of a request's prompt as the server sees it: lines that share a system
    prompt or a few-shot block share it (what the server's prefix cache can reuse)."""
    for name in ("messages", "input", "prompt"):
        value = body.get(name)
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return text[:PREFIX_CHARS]
    return ""


def reply_usage(body: Any) -> GenerationResult:
    """The tokens the server reports (``usage``; cached prompt tokens where it says)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    completion = _count(usage.get("completion_tokens"))
    return GenerationResult(
        prompt_tokens=_count(usage.get("prompt_tokens") or usage.get("input_tokens")),
        cached_tokens=_count(cached),
        choices=[ChoiceResult(0, "", "stop", completion or _count(usage.get("output_tokens")))],
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def reply_error(req: BatchRequest, reply: Reply) -> dict[str, Any]:
    """The error line of a request the server refused: its status, and its message and code
    where its body has them (OpenAI's ``{"error": {…}}``, vLLM's ``{"message": …}``,
    FastAPI's ``{"detail": …}``), with anything that looks like a key redacted (a server may
    quote the operator's key, or its fingerprint)."""
    body = reply.body if isinstance(reply.body, dict) else {}
    error = body.get("error")
    if not isinstance(error, dict):
        error = body
    message = error.get("message")
    if not isinstance(message, str) or not message:  # FastAPI's {"detail": …}
        detail = body.get("detail")
        message = detail if isinstance(detail, str) else json.dumps(detail) if detail else None
    if not isinstance(message, str) or not message:
        message = (reply.text or "").strip()[:500] or "no message"
    code = error.get("code")
    param = error.get("param")
    server_error = reply.status >= 500
    if not isinstance(code, str):
        code = "upstream_error" if server_error else None
    return request_error_line(
        req.custom_id,
        status_code=reply.status,
        message=f"The upstream answered {reply.status}: {redact(message)}",
        code=redact(code) if code is not None else None,
        param=redact(param) if isinstance(param, str) else None,
        type="server_error" if server_error else "invalid_request_error",
    )


class UpstreamHandler:
    """Chat, completions, embeddings and responses on an upstream model."""

    isolates_failures = False
    forwards_bodies = True

    def __init__(
        self,
        batch: Batch,
        host: Dispatcher,
        spec: UpstreamSpec,
        names: Mapping[str, str] | None = None,
    ):
        self.batch_id = batch.id
        self.host = host
        self.spec = spec
        # served name -> the model the server is sent: the base's (spec.model) but for the
        # LoRA adapters it serves (core.llms.specs.LoraSpec.forwarded_name)
        self.names: Mapping[str, str] = names or {}
        self.tenant = batch.tenant
        self.priority = Priority.parse(batch.priority).engine
        self.deadline = batch.expires_at.timestamp() if batch.expires_at is not None else None
        # Each tenant its own prefix cache (see Settings.share_prefix_cache_across_tenants).
        settings = get_settings()
        self.salt_key = None if settings.share_prefix_cache_across_tenants else salt_key(settings)

    def prepare(self, req: BatchRequest) -> tuple[tuple[str, dict[str, Any]], tuple[str, int]]:
        body = dict(req.body, model=self.names.get(req.model, self.spec.model))
        if self.salt_key is not None:
            body = salted_body(
                body,
                url=req.url,
                tenant=self.tenant,
                key=self.salt_key,
                salt_field=self.spec.cache_salt_field,
            )
        cost = max(1, len(json.dumps(body, ensure_ascii=False)) // 4) + (req.max_tokens or 16)
        return (req.url.removeprefix("/v1"), body), (prompt_prefix(body), cost)

    def submit(
        self,
        prompt: tuple[str, dict[str, Any]],
        params: tuple[str, int],
        done: Callable[[Future], None],
    ) -> None:
        path, body = prompt
        prefix, cost = params
        self.host.submit(
            path,
            body,
            group=self.batch_id,
            tenant=self.tenant,
            priority=self.priority,
            deadline=self.deadline,
            cost=cost,
            prefix=prefix,
            callback=done,
            timeout=SUBMIT_WAIT_S,
        )

    def outcome(self, req: BatchRequest, future: Future, submitted: float | None) -> RequestOutcome:
        reply: Reply = future.result()
        if reply.aborted:
            return Aborted(generation.aborted_record(req))
        if reply.status == 200 and isinstance(reply.body, dict):
            return Line(output_line(req.custom_id, reply.body), reply_usage(reply.body))
        if reply.status == 200:
            reply = Reply(502, None, "the upstream answered 200 with a body that is not JSON")
        return Line(reply_error(req, reply))

    def failed_line(self, req: BatchRequest, exc: BaseException, tries: int) -> dict[str, Any]:
        return error_for_exception(req, exc)

    def drained(self, timeout: float) -> bool:
        return self.host.pending() == 0  # not asked: its failures are not isolated
