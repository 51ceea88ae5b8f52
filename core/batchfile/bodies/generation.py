"""The bodies of ``/v1/chat/completions`` and ``/v1/completions``."""

from __future__ import annotations

from typing import Any

from core.batchfile.bodies.checker import Checker
from core.batchfile.bodies.fields import REFUSED
from core.batchfile.bodies.structured import guided, json_schema
from core.batchfile.bodies.tools import check_tools, history_tool_calls
from core.batchfile.request import CHAT_ROLES, BatchRequest, max_tokens_field, show

# apply_chat_template's own arguments: chat_template_kwargs holds variables for the template
# (``enable_thinking``, …), never these.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_chat(c: Checker, req: BatchRequest) -> None:
    body = c.body
    if "messages" not in body or body["messages"] is None:
        raise c.fail(
            "missing_required_param",
            "body.messages",
            "body.messages is required for chat completions",
        )
    messages = body["messages"]
    if not isinstance(messages, list):
        raise c.type_error("body.messages", "an array", messages)
    if not messages:
        raise c.fail("invalid_value", "body.messages", "body.messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        out.append(_message(c, req, msg, f"body.messages[{i}]"))
    req.messages = out

    c.common(req)
    refused = REFUSED["chat"]
    if c.get("function_call") == "none":  # the legacy spelling of tool_choice "none"
        refused = {k: v for k, v in refused.items() if k != "function_call"}
    c.refuse_unserved(refused)
    req.json_schema = json_schema(c, c.get("response_format"), "body.response_format", flat=False)
    req.chat_template_kwargs = _template_kwargs(c)
    modalities = c.get("modalities")
    if modalities is not None and modalities != ["text"] and not c.forwarded:
        raise c.fail(
            "unsupported_value",
            "body.modalities",
            f'body.modalities must be ["text"], got {show(modalities)}',
        )

    # both limits are checked; the one max_tokens_field names is the request's
    limits = {
        name: c.integer(name, 1, None, None) for name in ("max_completion_tokens", "max_tokens")
    }
    req.max_tokens_from = max_tokens_field(req.kind, body)
    req.max_tokens = limits[req.max_tokens_from]
    req.logprobs = c.boolean("logprobs", False)
    top = c.integer("top_logprobs", 0, 20, 0)
    if top and not req.logprobs:
        raise c.fail(
            "invalid_value",
            "body.top_logprobs",
            f"body.top_logprobs requires body.logprobs to be true, got top_logprobs={top}",
        )
    req.top_logprobs = top
    c.vllm_sampling(req)
    guided(c, req)
    check_tools(c, req)


def _message(c: Checker, req: BatchRequest, msg: Any, p: str) -> dict[str, Any]:
    """One message as the chat template reads it: text parts joined; an assistant turn's
    ``tool_calls`` (its content may then be null) and a tool turn's ``tool_call_id`` kept."""
    if not isinstance(msg, dict):
        raise c.type_error(p, "an object", msg)
    role = c.required(f"{p}.role", msg.get("role"))
    if not isinstance(role, str):
        raise c.type_error(f"{p}.role", "a string", role)
    c.choice(f"{p}.role", role, CHAT_ROLES)
    if msg.get("function_call") and not c.forwarded:
        raise c.fail(
            "unsupported_parameter",
            f"{p}.function_call",
            f"{p}.function_call is not supported by this service: use tool_calls",
        )
    flat: dict[str, Any] = {"role": role}
    calls = msg.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise c.fail(
                "invalid_value",
                f"{p}.tool_calls",
                f"{p}.tool_calls may only be set on an assistant message, not on a {role} one",
            )
        flat["tool_calls"] = history_tool_calls(c, calls, f"{p}.tool_calls")
        content = msg.get("content")
    else:
        content = c.required(f"{p}.content", msg.get("content"))
    if role == "tool":
        call_id = c.required(f"{p}.tool_call_id", msg.get("tool_call_id"))
        if not isinstance(call_id, str):
            raise c.type_error(f"{p}.tool_call_id", "a string", call_id)
        flat["tool_call_id"] = call_id
    if isinstance(content, list):
        content = "\n".join(_text_parts(c, req, content, f"{p}.content"))
    elif content is not None and not isinstance(content, str):
        raise c.type_error(f"{p}.content", "a string or an array of content parts", content)
    flat["content"] = content
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise c.type_error(f"{p}.name", "a string", name)
        flat["name"] = name
    return flat


def _text_parts(c: Checker, req: BatchRequest, content: list[Any], p: str) -> list[str]:
    """The texts of a message's content parts. Other parts (an ``image_url``, an audio or file
    part) go as written to an upstream model, which decides what it serves; a local model
    refuses the line naming the part, since the models served here take text only."""
    texts: list[str] = []
    for j, part in enumerate(content):
        pp = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise c.type_error(pp, "an object", part)
        ptype = part.get("type")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise c.type_error(f"{pp}.text", "a string", text)
            texts.append(text)
            continue
        if not isinstance(ptype, str):
            raise c.type_error(f"{pp}.type", "a string", ptype)
        if ptype == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str) or not url:
                raise c.type_error(f"{pp}.image_url.url", "a URL string", url)
            if not c.forwarded:
                raise c.fail(
                    "unsupported_value",
                    pp,
                    f"{pp} is an image_url part, but the model {show(req.model)} takes text "
                    "only (this service runs no vision model locally)",
                )
        elif not c.forwarded:
            raise c.fail(
                "unsupported_value",
                f"{pp}.type",
                f'{pp}.type must be "text": the model {show(req.model)} takes text only, '
                f"got {show(ptype)}",
            )
    return texts


def _template_kwargs(c: Checker) -> dict[str, Any] | None:
    value = c.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise c.type_error("body.chat_template_kwargs", "an object", value)
    for name in value:
        if name in TEMPLATE_ARGUMENTS:
            raise c.fail(
                "invalid_value",
                f"body.chat_template_kwargs.{name}",
                f"body.chat_template_kwargs.{name} is an argument of the template call, not a "
                "variable of the template; it cannot be set",
            )
    return dict(value) or None


def check_completion(c: Checker, req: BatchRequest) -> None:
    body = c.body
    if "prompt" not in body or body["prompt"] is None:
        raise c.fail(
            "missing_required_param", "body.prompt", "body.prompt is required for completions"
        )
    prompt = body["prompt"]
    param = "body.prompt"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise c.fail(
                "unsupported_value",
                param,
                f"{param} must hold one prompt per request, got {len(prompt)}; put each prompt on its own line",
            )
        prompt = prompt[0]
        param = "body.prompt[0]"
    if isinstance(prompt, str):
        if not prompt:
            raise c.fail("invalid_value", param, f"{param} must not be empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise c.fail("invalid_value", param, f"{param} must not be empty")
        for i, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise c.type_error(f"{param}[{i}]", "an integer token id", tok)
            if tok < 0:
                raise c.fail(
                    "invalid_value", f"{param}[{i}]", f"{param}[{i}] must be at least 0, got {tok}"
                )
        prompt = list(prompt)
    else:
        raise c.type_error(param, "a string or an array of token ids", prompt)
    req.prompt = prompt

    c.common(req)
    c.refuse_unserved(REFUSED["completion"])
    if c.boolean("echo", False):
        raise c.fail(
            "unsupported_value", "body.echo", "body.echo must be false: echo is not supported"
        )
    best_of = c.integer("best_of", 1, None, None)
    if best_of is not None and best_of != req.n:
        raise c.fail(
            "unsupported_value",
            "body.best_of",
            f"body.best_of must equal body.n ({req.n}), got {best_of}",
        )
    req.max_tokens_from = max_tokens_field(req.kind, body)
    req.max_tokens = c.integer(req.max_tokens_from, 1, None, None)
    # an extension: OpenAI's completions take no response_format; vLLM's do, as here
    req.json_schema = json_schema(c, c.get("response_format"), "body.response_format", flat=False)
    lp = c.integer("logprobs", 0, 5, None)
    req.logprobs = lp is not None
    req.top_logprobs = lp or 0
    c.vllm_sampling(req)
    guided(c, req)
