"""Anthropic's Message Batches formats, mapped onto the chat pipeline.

A Messages request (``params``) becomes one ``/v1/chat/completions`` line of an ordinary batch
input file, so everything that runs an OpenAI batch runs it; a chat result line becomes an
Anthropic result (``{custom_id, result: {type, message | error}}``). A request this service
cannot serve (an image block, tools, an unknown field) is not a line at all: it is an
``errored`` result naming the field, decided when the batch is created.
"""

from __future__ import annotations

import math
import re
from typing import Any

from core.batches.ids import message_id
from core.batchfile.request import CHAT_URL, show

#: Anthropic's rule for a request's ``custom_id``.
CUSTOM_ID_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Anthropic's limit on the requests of one batch.
MAX_REQUESTS = 100_000

#: Messages fields served (``metadata`` and ``service_tier`` are accepted and have no effect).
SERVED_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "service_tier",
)
#: Messages fields that exist but that this service cannot serve.
UNSERVED_FIELDS = {
    "tools": "tools are not supported by this service",
    "tool_choice": "tools are not supported by this service",
    "thinking": "extended thinking is not supported by this service",
    "container": "containers are not supported by this service",
    "mcp_servers": "MCP servers are not supported by this service",
}
ROLES = ("user", "assistant")

#: The chat checker's field names, as the Messages API calls them.
_PARAM_NAMES = {
    "body.stop": "params.stop_sequences",
    "body.max_completion_tokens": "params.max_tokens",
}


class UnservableRequest(Exception):
    """A request that can only be an ``errored`` result: ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def _fail(param: str, why: str) -> UnservableRequest:
    return UnservableRequest(param, f"{param}: {why}")


def _text_blocks(value: Any, param: str) -> str:
    """A string, or a list of ``text`` blocks joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(param, f"expected a string or an array of content blocks, got {show(value)}")
    texts: list[str] = []
    for j, block in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(block, dict):
            raise _fail(where, f"expected a content block object, got {show(block)}")
        kind = block.get("type")
        if kind != "text":
            raise _fail(
                f"{where}.type",
                f"{show(kind)} content blocks are not supported by this service (text only)",
            )
        text = block.get("text")
        if not isinstance(text, str):
            raise _fail(f"{where}.text", f"expected a string, got {show(text)}")
        texts.append(text)
    return "\n".join(texts)


def _number(params: dict[str, Any], name: str, low: float, high: float) -> None:
    value = params.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _fail(f"params.{name}", f"expected a number from {low} to {high}, got {show(value)}")


def _finite(params: dict[str, Any]) -> None:
    """Refuse a NaN or an infinity anywhere in ``params``. JSON has neither, but Python's
    parser reads ``NaN``, ``Infinity`` and ``1e999`` as floats: one would pass the range checks
    and only fail where the line is written (the whole create, not its request)."""
    stack: list[tuple[str, Any]] = [("params", params)]
    while stack:
        param, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            shown = "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
            raise _fail(param, f"{shown} is not a number JSON allows; expected a finite number")
        if isinstance(value, dict):
            stack.extend((f"{param}.{k}", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{param}[{i}]", v) for i, v in reversed(list(enumerate(value))))


def chat_body(params: Any) -> dict[str, Any]:
    """The chat completions body that serves the Messages ``params``, or
    :class:`UnservableRequest` naming the first field that cannot be served."""
    if not isinstance(params, dict):
        raise _fail("params", f"expected an object, got {show(params)}")
    _finite(params)
    for name in params:
        if name in UNSERVED_FIELDS and params[name] not in (None, [], {}):
            raise _fail(f"params.{name}", UNSERVED_FIELDS[name])
        if name not in SERVED_FIELDS and name not in UNSERVED_FIELDS:
            raise _fail(f"params.{name}", "extra inputs are not permitted")
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("params.model", f"a model name is required, got {show(model)}")
    max_tokens = params.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _fail(
            "params.max_tokens", f"an integer of at least 1 is required, got {show(max_tokens)}"
        )
    if params.get("stream"):
        raise _fail("params.stream", "batch requests cannot be streamed")
    _number(params, "temperature", 0.0, 1.0)
    _number(params, "top_p", 0.0, 1.0)
    messages: list[dict[str, str]] = []
    if params.get("system") is not None:
        messages.append(
            {"role": "system", "content": _text_blocks(params["system"], "params.system")}
        )
    turns = params.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _fail(
            "params.messages", f"a non-empty array of messages is required, got {show(turns)}"
        )
    for i, turn in enumerate(turns):
        where = f"params.messages[{i}]"
        if not isinstance(turn, dict):
            raise _fail(where, f"expected a message object, got {show(turn)}")
        role = turn.get("role")
        if role not in ROLES:
            raise _fail(f"{where}.role", f"expected 'user' or 'assistant', got {show(role)}")
        messages.append(
            {"role": role, "content": _text_blocks(turn.get("content"), f"{where}.content")}
        )
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if params.get(name) is not None:
            body[name] = params[name]
    if params.get("stop_sequences"):
        body["stop"] = params["stop_sequences"]
    return body


def chat_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}


def messages_param(param: str | None) -> str | None:
    """A chat checker's ``body.…`` field as the Messages request calls it."""
    if param is None:
        return None
    return _PARAM_NAMES.get(param, "params." + param.removeprefix("body."))


# --------------------------------------------------------------------------------------------
# Results


def errored(error_type: str, message: str) -> dict[str, Any]:
    return {
        "type": "errored",
        "error": {"type": "error", "error": {"type": error_type, "message": message}},
    }


def _message(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as a Messages response."""
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    finish = choice.get("finish_reason")
    stop = choice.get("stop_reason")  # the stop string that ended it (the engine's, vLLM's)
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [{"type": "text", "text": (choice.get("message") or {}).get("content") or ""}],
        "stop_reason": "max_tokens"
        if finish == "length"
        else "stop_sequence"
        if isinstance(stop, str)
        else "end_turn",
        "stop_sequence": stop if isinstance(stop, str) else None,
        "usage": {
            "input_tokens": max(int(usage.get("prompt_tokens") or 0) - int(cached), 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": int(cached),
        },
    }


#: A batch-level error code on a line that never ran, as Anthropic's result type.
_NOT_RUN = {"batch_cancelled": "canceled", "batch_expired": "expired"}


def result_of(line: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic ``result`` of one line of a batch's output or error file."""
    response = line.get("response")
    if response is None:
        error = line.get("error") or {}
        kind = _NOT_RUN.get(error.get("code") or "")
        if kind is not None:
            return {"type": kind}
        return errored("api_error", error.get("message") or "The request was not run.")
    body = response.get("body") or {}
    if response.get("status_code") == 200:
        return {"type": "succeeded", "message": _message(body)}
    error = body.get("error") or {}
    status = response.get("status_code") or 500
    kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
    message = error.get("message") or "The request failed."
    if error.get("param"):
        message = f"{messages_param(error['param'])}: {message}"
    return errored(kind, message)
