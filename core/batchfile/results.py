"""The OpenAI batch output format: response bodies, output lines and error lines.

The shard task turns engine output into plain :class:`GenerationResult` values (this module
never imports the engine) and writes ``dumps_line(output_line(custom_id, body))``; a request's
own failure is a :func:`request_error_line`, a request never run (expired, cancelled) a
:func:`batch_error_line`. The shapes follow OpenAI's objects (docs/core.md); every line is
valid JSON (a ``-inf`` logprob is written as ``-9999.0``)."""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from core.batches.ids import batch_request_id, message_id, response_id
from core.batches.ids import chat_completion_id as new_chat_completion_id
from core.batches.ids import completion_id as new_completion_id
from core.batches.ids import request_id as new_request_id

if TYPE_CHECKING:
    from core.batchfile.request import BatchRequest

__all__ = [
    "BATCH_ERROR_MESSAGES",
    "ChoiceResult",
    "GenerationResult",
    "TokenLogprobInfo",
    "batch_error_line",
    "chat_completion_body",
    "completion_body",
    "dumps_line",
    "new_chat_completion_id",
    "new_completion_id",
    "new_request_id",
    "output_line",
    "parse_tool_calls",
    "request_error_line",
    "response_body",
    "responses_body",
    "usage_dict",
]

MIN_LOGPROB = -9999.0

BATCH_ERROR_MESSAGES: dict[str, str] = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was cancelled before it could be executed.",
}


# --------------------------------------------------------------------------------------------
# Inputs (filled in by the worker from the engine's outputs)


@dataclass(slots=True)
class TokenLogprobInfo:
    """One generated token: its text, logprob, UTF-8 bytes, and the most likely alternatives
    as ``(token, logprob, bytes)`` tuples, most likely first."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[tuple[str, float, list[int] | None]] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    logprobs: list[TokenLogprobInfo] | None = None
    stop_reason: str | int | None = None  # the stop string (or token id) that ended it


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int
    cached_tokens: int
    choices: list[ChoiceResult]

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


# --------------------------------------------------------------------------------------------
# Bodies


def _finite(x: float) -> float:
    x = float(x)
    if math.isnan(x) or x < MIN_LOGPROB:
        return MIN_LOGPROB
    return x


def _token_bytes(token: str, given: list[int] | None) -> list[int] | None:
    return list(given) if given is not None else list(token.encode("utf-8", "surrogatepass"))


def usage_dict(result: GenerationResult) -> dict[str, Any]:
    completion = result.completion_tokens
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_logprobs(req: BatchRequest, choice: ChoiceResult) -> dict[str, Any] | None:
    if not req.logprobs or choice.logprobs is None:
        return None
    content = []
    for t in choice.logprobs:
        content.append(
            {
                "token": t.token,
                "logprob": _finite(t.logprob),
                "bytes": _token_bytes(t.token, t.bytes),
                "top_logprobs": [
                    {"token": tok, "logprob": _finite(lp), "bytes": _token_bytes(tok, b)}
                    for tok, lp, b in t.top[: req.top_logprobs]
                ],
            }
        )
    return {"content": content, "refusal": None}


class BodyOptions(TypedDict, total=False):
    """What a caller may set on a generation body; by default ``created`` is now (Unix
    seconds), ``model`` the request's model, ``system_fingerprint`` null."""

    created: int | None
    model: str | None
    system_fingerprint: str | None


class CompletionOptions(BodyOptions, total=False):
    completion_id: str | None  # default: a fresh id of the body's kind


class ResponseOptions(BodyOptions, total=False):
    response_id: str | None  # default: a fresh ``resp_…``


#: One call in the Hermes / Qwen2.5 format: ``<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>``.
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(
    text: str, names: Collection[str]
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """The content and OpenAI ``tool_calls`` of a completion in the Hermes / Qwen2.5 format
    (one or more ``<tool_call>`` blocks, each a JSON object with a ``name`` among ``names`` and
    object ``arguments``); the content is the text around the calls, None when there is none.
    None when ``text`` holds no call, or a block that is not a valid call: the text then stays
    the content."""
    blocks = list(_TOOL_CALL.finditer(text))
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.group(1))
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(
            {
                "id": tool_call_id(),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


def _chat_choice(req: BatchRequest, c: ChoiceResult) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": c.text,
        "refusal": None,
        "annotations": [],
    }
    finish = c.finish_reason
    parsed = None
    if req.tools and finish == "stop":
        parsed = parse_tool_calls(c.text, [t["function"]["name"] for t in req.tools])
    if parsed is not None:
        content, calls = parsed
        if not req.parallel_tool_calls:
            calls = calls[:1]
        message["content"] = content
        message["tool_calls"] = calls
        finish = "tool_calls"
    return {
        "index": c.index,
        "message": message,
        "logprobs": _chat_logprobs(req, c),
        "finish_reason": finish,
        **({} if parsed is not None else _stop_reason(c)),
    }


def _stop_reason(c: ChoiceResult) -> dict[str, Any]:
    """vLLM's ``stop_reason`` on a choice that a stop string or stop token ended (absent
    otherwise, so a plain choice keeps OpenAI's shape): what Anthropic's ``stop_sequence`` is."""
    return {"stop_reason": c.stop_reason} if c.stop_reason is not None else {}


def chat_completion_body(
    req: BatchRequest, result: GenerationResult, **options: Unpack[CompletionOptions]
) -> dict[str, Any]:
    """A ``chat.completion`` object, with a ``chatcmpl-…`` id unless ``completion_id``."""
    return _envelope("chat.completion", new_chat_completion_id, _chat_choice, req, result, options)


def _completion_logprobs(req: BatchRequest, choice: ChoiceResult) -> dict[str, Any] | None:
    if not req.logprobs or choice.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    offset = 0
    for t in choice.logprobs:
        tokens.append(t.token)
        token_logprobs.append(_finite(t.logprob))
        top_logprobs.append({tok: _finite(lp) for tok, lp, _ in t.top[: req.top_logprobs]})
        text_offset.append(offset)
        offset += len(t.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _completion_choice(req: BatchRequest, c: ChoiceResult) -> dict[str, Any]:
    return {
        "text": c.text,
        "index": c.index,
        "logprobs": _completion_logprobs(req, c),
        "finish_reason": c.finish_reason,
        **_stop_reason(c),
    }


def completion_body(
    req: BatchRequest, result: GenerationResult, **options: Unpack[CompletionOptions]
) -> dict[str, Any]:
    """A ``text_completion`` object (the legacy completions API), with a ``cmpl-…`` id unless
    ``completion_id``."""
    return _envelope("text_completion", new_completion_id, _completion_choice, req, result, options)


def _envelope(
    obj: str,
    new_id: Callable[[], str],
    choice: Callable[[BatchRequest, ChoiceResult], dict[str, Any]],
    req: BatchRequest,
    result: GenerationResult,
    options: CompletionOptions,
) -> dict[str, Any]:
    """The fields a ChatCompletion and a Completion share around their choices."""
    created = options.get("created")
    return {
        "id": options.get("completion_id") or new_id(),
        "object": obj,
        "created": int(time.time()) if created is None else created,
        "model": options.get("model") or req.model,
        "choices": [choice(req, c) for c in sorted(result.choices, key=lambda c: c.index)],
        "usage": usage_dict(result),
        "system_fingerprint": options.get("system_fingerprint"),
    }


def responses_body(
    req: BatchRequest, result: GenerationResult, **options: Unpack[ResponseOptions]
) -> dict[str, Any]:
    """A ``response`` object of the Responses API: one assistant message with one
    ``output_text`` part. A completion cut by ``max_output_tokens`` is ``incomplete`` with
    ``incomplete_details.reason`` ``max_output_tokens``, as OpenAI reports it. The request's
    ``instructions``, ``metadata``, sampling values and ``text.format`` are echoed; the
    Response object has no ``system_fingerprint``."""
    body = req.body
    choice = min(result.choices, key=lambda c: c.index)
    cut = choice.finish_reason == "length"
    created = options.get("created")
    status = "incomplete" if cut else "completed"
    text = body.get("text")
    if not isinstance(text, dict):
        text = {}
    message = {
        "type": "message",
        "id": message_id(),
        "status": status,
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": choice.text, "annotations": [], "logprobs": []}
        ],
    }
    return {
        "id": options.get("response_id") or response_id(),
        "object": "response",
        "created_at": int(time.time()) if created is None else created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": options.get("model") or req.model,
        "output": [message],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": req.temperature,
        "text": {**text, "format": text.get("format") or {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        },
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def response_body(req: BatchRequest, result: GenerationResult, **kwargs: Any) -> dict[str, Any]:
    """The body of ``req``'s endpoint: :func:`chat_completion_body`, :func:`completion_body`
    or :func:`responses_body`."""
    if req.kind == "chat":
        return chat_completion_body(req, result, **kwargs)
    if req.kind == "response":
        return responses_body(req, result, **kwargs)
    return completion_body(req, result, **kwargs)


def embedding_body(
    req: BatchRequest, vectors: list[Any], prompt_tokens: int, *, model: str | None = None
) -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse`` for ``req``: one entry per input, in input order.

    ``vectors`` are sequences of floats (lists, or 1-D float arrays/tensors with ``tolist``);
    ``encoding_format: "base64"`` sends each as the base64 of its little-endian float32 bytes,
    which is what OpenAI returns and its SDK decodes."""
    data = []
    for index, vector in enumerate(vectors):
        values = vector.tolist() if hasattr(vector, "tolist") else list(vector)
        if req.encoding_format == "base64":
            encoded: Any = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        else:
            encoded = [float(v) for v in values]
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return {
        "object": "list",
        "data": data,
        "model": model or req.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


# --------------------------------------------------------------------------------------------
# Lines


def output_line(
    custom_id: str, body: dict[str, Any], *, request_id: str | None = None
) -> dict[str, Any]:
    """A successful request's line in the output file."""
    return _response_line(custom_id, 200, body, request_id)


def _response_line(
    custom_id: str | None, status_code: int, body: dict[str, Any], request_id: str | None
) -> dict[str, Any]:
    """A line carrying the HTTP response the endpoint returned (or would have)."""
    return {
        "id": batch_request_id(),
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": request_id or new_request_id(),
            "body": body,
        },
        "error": None,
    }


def request_error_line(
    custom_id: str | None,
    *,
    status_code: int = 400,
    message: str,
    code: str | None,
    param: str | None = None,
    type: str = "invalid_request_error",
    request_id: str | None = None,
) -> dict[str, Any]:
    """A request that ran (or was attempted) and failed: its line in the error file, shaped as
    the HTTP error response the endpoint would have returned."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return _response_line(custom_id, status_code, {"error": error}, request_id)


def batch_error_line(
    custom_id: str | None, code: str, message: str | None = None
) -> dict[str, Any]:
    """A request never executed because of the batch (``batch_expired``, ``batch_cancelled``,
    or another code with its ``message``)."""
    if message is None:
        try:
            message = BATCH_ERROR_MESSAGES[code]
        except KeyError:
            raise ValueError(f"batch_error_line: no default message for code {code!r}") from None
    return {
        "id": batch_request_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def dumps_line(obj: Any) -> bytes:
    """One JSONL line: compact JSON, UTF-8, ending in ``\\n``. Strings holding lone
    surrogates (possible via ``\\ud800`` escapes in the input) are written escaped, so the
    line is always valid UTF-8 and round-trips exactly. NaN/Infinity raise ``ValueError``."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()
    return data + b"\n"
