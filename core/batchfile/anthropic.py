"""Anthropic's Message Batches formats, mapped onto the chat pipeline.

A Messages request (``params``) becomes one ``/v1/chat/completions`` line of an ordinary batch
input file, so everything that runs an OpenAI batch runs it; a chat result line becomes an
Anthropic result (``{custom_id, result: {type, message | error}}``). A request this service
cannot serve (a malformed block, extended thinking, an unknown field) is not a line at all: it is an
``errored`` result naming the field, decided when the batch is created.
"""

from __future__ import annotations

import json
import math
import re
import secrets
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
    "tools",
    "tool_choice",
)
#: Messages fields that exist but that this service cannot serve.
UNSERVED_FIELDS = {
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
#: ... and the parts of them a tool's field is in: ``body.tools[2].function.parameters`` is
#: ``params.tools[2].input_schema``.
_TOOL_PARAM = re.compile(r"^body\.tools(\[\d+\])(?:\.function(?:\.(\w+))?)?(.*)$")
_TOOL_FIELDS = {"parameters": "input_schema"}


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
                f"{show(kind)} content blocks are not supported here (text only)",
            )
        texts.append(_text(block, where))
    return "\n".join(texts)


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail(f"{where}.text", f"expected a string, got {show(text)}")
    return text


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``image`` block as OpenAI's ``image_url`` part: base64 data as a ``data:`` URL, a URL
    as itself (never fetched here: an upstream model reads it, a local one refuses it)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _fail(f"{where}.source", f"expected an object, got {show(source)}")
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        data = source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise _fail(
                f"{where}.source.media_type",
                f"expected an image media type (image/png, ...), got {show(media_type)}",
            )
        if not isinstance(data, str) or not data:
            raise _fail(f"{where}.source.data", f"expected base64 text, got {show(data)}")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        given = source.get("url")
        if not isinstance(given, str) or not given:
            raise _fail(f"{where}.source.url", f"expected a URL, got {show(given)}")
        url = given
    else:
        raise _fail(f"{where}.source.type", f"expected 'base64' or 'url', got {show(kind)}")
    return {"type": "image_url", "image_url": {"url": url}}


def _turn(turn: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: text and image blocks as the turn's content parts,
    an assistant's ``tool_use`` blocks as its ``tool_calls``, a user's ``tool_result`` blocks
    as ``tool`` messages (before the rest of the turn, which answers after them)."""
    role = turn.get("role")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _fail(
            f"{where}.content",
            f"expected a string or an array of content blocks, got {show(content)}",
        )
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise _fail(at, f"expected a content block object, got {show(block)}")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            raise _fail(
                f"{at}.type",
                f"{show(kind)} content blocks are not supported in a {role} turn here",
            )
    messages: list[dict[str, Any]] = list(results)
    if calls:
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts or not results:
        texts_only = all(p["type"] == "text" for p in parts)
        value: Any = "\n".join(p["text"] for p in parts) if texts_only else parts
        messages.append({"role": role, "content": value})
    return messages


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.id", f"expected a string, got {show(call_id)}")
    if not isinstance(name, str) or not name:
        raise _fail(f"{where}.name", f"expected a string, got {show(name)}")
    if not isinstance(args, dict):
        raise _fail(f"{where}.input", f"expected an object, got {show(args)}")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.tool_use_id", f"expected a string, got {show(call_id)}")
    content = block.get("content", "")
    text = _text_blocks(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(params: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat body's fields (the chat checker then checks
    each function as it checks OpenAI's)."""
    out: dict[str, Any] = {}
    tools = params.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise _fail("params.tools", f"expected an array of tools, got {show(tools)}")
        functions = []
        for i, tool in enumerate(tools):
            where = f"params.tools[{i}]"
            if not isinstance(tool, dict):
                raise _fail(where, f"expected a tool object, got {show(tool)}")
            if tool.get("type") not in (None, "custom"):
                raise _fail(
                    f"{where}.type",
                    f"{show(tool.get('type'))} (a server tool) is not supported here: "
                    "client tools (name, description, input_schema) only",
                )
            if tool.get("input_schema") is None:
                raise _fail(f"{where}.input_schema", "a tool's input_schema is required")
            function: dict[str, Any] = {"name": tool.get("name")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            function["parameters"] = tool["input_schema"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    choice = params.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict):
            raise _fail("params.tool_choice", f"expected an object, got {show(choice)}")
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in _TOOL_CHOICES:
            out["tool_choice"] = _TOOL_CHOICES[kind]
        else:
            raise _fail(
                "params.tool_choice.type",
                f"expected 'auto', 'any', 'tool' or 'none', got {show(kind)}",
            )
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None:
            if not isinstance(disable, bool):
                raise _fail(
                    "params.tool_choice.disable_parallel_tool_use",
                    f"expected a boolean, got {show(disable)}",
                )
            out["parallel_tool_calls"] = not disable
    return out


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


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
    messages: list[dict[str, Any]] = []
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
        messages.extend(_turn(turn, where))
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if params.get(name) is not None:
            body[name] = params[name]
    if params.get("stop_sequences"):
        body["stop"] = params["stop_sequences"]
    body.update(_tools(params))
    return body


def chat_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}


def messages_param(param: str | None) -> str | None:
    """A chat checker's ``body.…`` field as the Messages request calls it."""
    if param is None:
        return None
    tool = _TOOL_PARAM.match(param)
    if tool is not None:
        index, field, rest = tool.groups()
        named = "" if field is None else "." + _TOOL_FIELDS.get(field, field)
        return f"params.tools{index}{named}{rest}"
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
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        content.append({"type": "text", "text": message.get("content") or ""})
    content.extend(_tool_use_block(call) for call in calls)
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": content,
        "stop_reason": "max_tokens"
        if finish == "length"
        else "tool_use"
        if calls
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


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as a ``tool_use`` content block (its arguments as an object)."""
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": f"toolu_{secrets.token_hex(12)}",
        "name": function.get("name"),
        "input": arguments if isinstance(arguments, dict) else {},
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
