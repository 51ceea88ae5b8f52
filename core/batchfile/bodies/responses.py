"""The body of ``/v1/responses`` (OpenAI's Responses API), run as a chat request.

``input`` (a string, or message items with text parts) and ``instructions`` (a leading system
message) become the messages of the model's chat template; ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format``, ``metadata`` and ``user`` are read. What this
service cannot do (tools, non-text input, stateful fields, ...: docs/api.md) is refused per
line, naming the field."""

from __future__ import annotations

import json
from typing import Any

from core.batchfile.bodies.checker import Checker
from core.batchfile.bodies.fields import REFUSED, REFUSED_EVERYWHERE
from core.batchfile.bodies.structured import json_schema
from core.batchfile.request import BatchRequest, max_tokens_field, show

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def check_response(c: Checker, req: BatchRequest) -> None:
    body = c.body
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise c.type_error("body.instructions", "a string", instructions)
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if value is None:
        raise c.fail("missing_required_param", "body.input", "body.input is required for responses")
    if isinstance(value, str):
        if not value:
            raise c.fail("invalid_value", "body.input", "body.input must not be empty")
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        if not value:
            raise c.fail("invalid_value", "body.input", "body.input must not be an empty array")
        messages.extend(_item(c, item, f"body.input[{i}]") for i, item in enumerate(value))
    else:
        raise c.type_error("body.input", "a string or an array of input items", value)
    req.messages = messages

    _refuse_unsupported(c)
    req.temperature = c.number("temperature", 0.0, 2.0, 1.0)
    req.top_p = c.number("top_p", 0.0, 1.0, 1.0, lo_open=True)
    req.max_tokens_from = max_tokens_field(req.kind, body)
    req.max_tokens = c.integer(req.max_tokens_from, 1, None, None)
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise c.type_error("body.text", "an object", text)
        req.json_schema = json_schema(c, text.get("format"), "body.text.format", flat=True)
    _check_metadata(c, body.get("metadata"))
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise c.type_error(f"body.{name}", "a string", body[name])


def _item(c: Checker, item: Any, p: str) -> dict[str, str]:
    """One input item as a chat message; an upstream model's line may hold items and parts a
    local model refuses (tools' items, images, files), which it gets as written."""
    if not isinstance(item, dict):
        raise c.type_error(p, "an object (a message item)", item)
    kind = item.get("type", "message")
    if kind != "message" and c.forwarded:
        # an upstream model reads it (a function call, its output, …); its text is what the
        # prompt's size is estimated from
        return {"role": "user", "content": json.dumps(item, ensure_ascii=False)}
    if kind != "message":
        raise c.fail(
            "unsupported_value",
            f"{p}.type",
            f'{p}.type must be "message": this service generates text only (no tools, function '
            f"calls or reasoning items), got {show(kind)}",
        )
    role = c.choice(f"{p}.role", c.required(f"{p}.role", item.get("role")), ROLES)
    content = c.required(f"{p}.content", item.get("content"))
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise c.type_error(f"{p}.content", "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        pp = f"{p}.content[{j}]"
        if not isinstance(part, dict):
            raise c.type_error(pp, "an object", part)
        ptype = part.get("type")
        if ptype not in TEXT_PARTS and c.forwarded:
            continue  # an image, a file, audio: the upstream model reads it as written
        if ptype not in TEXT_PARTS:
            raise c.fail(
                "unsupported_value",
                f"{pp}.type",
                f"{pp}.type must be input_text or output_text (this service serves text only; "
                f"images, files and audio are not supported), got {show(ptype)}",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise c.type_error(f"{pp}.text", "a string", text)
        texts.append(text)
    return {"role": role, "content": "\n".join(texts)}


def _refuse_unsupported(c: Checker) -> None:
    if c.get("stream") is not None and c.boolean("stream", False):
        raise c.fail(
            "unsupported_value",
            "body.stream",
            "body.stream must be false: batch requests cannot be streamed",
        )
    if c.boolean("background", False):
        raise c.fail(
            "unsupported_value",
            "body.background",
            "body.background must be false: a batch request already runs in the background",
        )
    c.refuse_unserved(REFUSED["response"])
    tool_choice = c.get("tool_choice")
    if tool_choice is not None and tool_choice not in ("none", "auto") and not c.forwarded:
        raise c.fail(
            "unsupported_parameter",
            "body.tool_choice",
            "body.tool_choice is not supported on /v1/responses: use /v1/chat/completions "
            "for tools",
        )
    for name, why in REFUSED_EVERYWHERE["response"].items():
        c.reject_if_set(name, why)
    if c.integer("top_logprobs", 0, 20, 0):
        raise c.fail(
            "unsupported_parameter",
            "body.top_logprobs",
            "body.top_logprobs is not supported by this service",
        )
    truncation = c.get("truncation")
    if truncation is not None and truncation != "disabled":
        raise c.fail(
            "unsupported_value",
            "body.truncation",
            f'body.truncation must be "disabled" (a prompt longer than the context is an '
            f"error, never cut), got {show(truncation)}",
        )


def _check_metadata(c: Checker, metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise c.type_error("body.metadata", "an object of strings", metadata)
    if len(metadata) > MAX_METADATA_PAIRS:
        raise c.fail(
            "invalid_value",
            "body.metadata",
            f"body.metadata may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise c.fail(
                "invalid_value",
                "body.metadata",
                f"body.metadata keys may be at most {MAX_METADATA_KEY} characters, got {len(key)}",
            )
        if not isinstance(value, str):
            raise c.type_error(f"body.metadata.{key}", "a string", value)
        if len(value) > MAX_METADATA_VALUE:
            raise c.fail(
                "invalid_value",
                f"body.metadata.{key}",
                f"body.metadata.{key} may be at most {MAX_METADATA_VALUE} characters, got {len(value)}",
            )
