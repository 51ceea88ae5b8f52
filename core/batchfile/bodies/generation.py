"""The bodies of ``/v1/chat/completions`` and ``/v1/completions``."""

from __future__ import annotations

from typing import Any

from core.batchfile.bodies.checker import Checker
from core.batchfile.bodies.structured import guided, json_schema
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
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        p = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            raise c.type_error(p, "an object", msg)
        role = c.required(f"{p}.role", msg.get("role"))
        if not isinstance(role, str):
            raise c.type_error(f"{p}.role", "a string", role)
        c.choice(f"{p}.role", role, CHAT_ROLES)
        if msg.get("tool_calls") or msg.get("function_call"):
            key = "tool_calls" if msg.get("tool_calls") else "function_call"
            raise c.fail(
                "unsupported_parameter", f"{p}.{key}", f"{p}.{key} is not supported by this service"
            )
        content = c.required(f"{p}.content", msg.get("content"))
        if isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                pp = f"{p}.content[{j}]"
                if not isinstance(part, dict):
                    raise c.type_error(pp, "an object", part)
                ptype = part.get("type")
                if ptype != "text":
                    if not isinstance(ptype, str):
                        raise c.type_error(f"{pp}.type", "a string", ptype)
                    raise c.fail(
                        "unsupported_value",
                        f"{pp}.type",
                        f'{pp}.type must be "text" (this service serves text only), got {show(ptype)}',
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise c.type_error(f"{pp}.text", "a string", text)
                texts.append(text)
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise c.type_error(f"{p}.content", "a string or an array of content parts", content)
        flat = {"role": role, "content": content}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise c.type_error(f"{p}.name", "a string", name)
            flat["name"] = name
        out.append(flat)
    req.messages = out

    c.common(req)
    for name in ("tools", "functions", "web_search_options", "moderation"):
        c.reject_if_set(name)
    for name in ("tool_choice", "function_call"):
        choice = c.get(name)
        if choice is not None and choice != "none":
            raise c.fail(
                "unsupported_parameter",
                f"body.{name}",
                f"body.{name} is not supported by this service",
            )
    req.json_schema = json_schema(c, c.get("response_format"), "body.response_format", flat=False)
    req.chat_template_kwargs = _template_kwargs(c)
    modalities = c.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise c.fail(
            "unsupported_value",
            "body.modalities",
            f'body.modalities must be ["text"], got {show(modalities)}',
        )
    c.reject_if_set("audio")

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
    c.reject_if_set("suffix")
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
