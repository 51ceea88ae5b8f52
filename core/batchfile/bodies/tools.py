"""Tools in a chat body: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

The functions are checked here (OpenAI's shape; each ``parameters`` a JSON Schema the engine's
grammar compiler accepts) and kept for the model's chat template. ``tool_choice``:

* ``"auto"`` (the default): the prompt holds the tools, the output is free and parsed for calls
  (:func:`core.batchfile.results.parse_tool_calls`);
* ``"none"``: the prompt is rendered without the tools;
* ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: one call is enforced by
  the structured-output grammar. The prompt ends with :data:`TOOL_CALL_OPEN` (Hermes' and
  Qwen2.5's ``<tool_call>``) and the output is held to the JSON Schema of
  :func:`call_schema`, ``{"name": <a function's name>, "arguments": <its parameters>}``, so the
  arguments are valid for their function; the result closes the call with
  :data:`TOOL_CALL_CLOSE`.

Whether a local model's chat template can render tools is known only where its tokenizer is
(:func:`core.llms.generation.prompt_token_ids`); a line forwarded to an upstream model goes as
written."""

from __future__ import annotations

import json
import re
from typing import Any

from core.batchfile.bodies.checker import Checker
from core.batchfile.bodies.structured import schema_problem
from core.batchfile.request import BatchRequest, show

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def check_tools(c: Checker, req: BatchRequest) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` into ``req``; read after
    ``response_format`` and the guided fields (``req.json_schema``, ``req.regex``,
    ``req.choice``): a forced call is structured output of its own."""
    tools = _tools(c, c.get("tools"))
    names = [t["function"]["name"] for t in tools]
    choice = _choice(c, c.get("tool_choice"), names)
    req.parallel_tool_calls = c.boolean("parallel_tool_calls", True)
    if not tools or choice == "none":
        return
    req.tools = tools
    req.tool_choice = choice
    if choice == "auto":
        return
    other = next(
        (
            name
            for name, value in (
                ("response_format", req.json_schema),
                ("guided_regex", req.regex),
                ("guided_choice", req.choice),
            )
            if value is not None
        ),
        None,
    )
    if other is not None:
        if other == "response_format" and c.get("guided_json") is not None:
            other = "guided_json"
        raise c.fail(
            "invalid_value",
            "body.tool_choice",
            f"body.tool_choice {show(c.get('tool_choice'))} forces a tool call, which cannot be "
            f"combined with body.{other}: a request asks for one kind of structured output",
        )
    wanted = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    req.json_schema = call_schema(wanted)


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call of one of ``tools``: its name and arguments."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _tools(c: Checker, value: Any) -> list[dict[str, Any]]:
    param = "body.tools"
    if value is None:
        return []
    if not isinstance(value, list):
        raise c.type_error(param, "an array of tools", value)
    if len(value) > MAX_TOOLS:
        raise c.fail(
            "invalid_value", param, f"{param} may hold at most {MAX_TOOLS} tools, got {len(value)}"
        )
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise c.type_error(p, "an object", tool)
        kind = c.required(f"{p}.type", tool.get("type"))
        if kind != "function":
            raise c.fail(
                "invalid_value", f"{p}.type", f'{p}.type must be "function", got {show(kind)}'
            )
        fn = c.required(f"{p}.function", tool.get("function"))
        if not isinstance(fn, dict):
            raise c.type_error(f"{p}.function", "an object", fn)
        name = c.required(f"{p}.function.name", fn.get("name"))
        if not isinstance(name, str) or not _NAME.match(name):
            raise c.fail(
                "invalid_value",
                f"{p}.function.name",
                f"{p}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                f"got {show(name)}",
            )
        if name in seen:
            raise c.fail(
                "invalid_value",
                f"{p}.function.name",
                f"{p}.function.name {show(name)} names an earlier tool too; names must differ",
            )
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise c.type_error(f"{p}.function.description", "a string", description)
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise c.type_error(f"{p}.function.strict", "a boolean", strict)
        parameters = fn.get("parameters")
        if parameters is not None:
            where = f"{p}.function.parameters"
            if not isinstance(parameters, dict):
                raise c.type_error(where, "an object (a JSON Schema)", parameters)
            problem = schema_problem(parameters)
            if problem is not None:
                raise c.fail(
                    "unsupported_value",
                    where,
                    f"{where} cannot be enforced by this service: {problem}",
                )
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = parameters if parameters is not None else {"type": "object"}
        tools.append({"type": "function", "function": function})
    return tools


def _choice(c: Checker, value: Any, names: list[str]) -> str:
    param = "body.tool_choice"
    if value is None:
        return "auto"
    if isinstance(value, str):
        c.choice(param, value, TOOL_CHOICES)
        if value != "none" and not names:
            raise c.fail(
                "invalid_value", param, f"{param} {show(value)} requires body.tools to be set"
            )
        return value
    if not isinstance(value, dict):
        raise c.type_error(param, 'one of "none", "auto", "required" or an object', value)
    kind = value.get("type")
    if kind != "function":
        raise c.fail(
            "invalid_value", f"{param}.type", f'{param}.type must be "function", got {show(kind)}'
        )
    fn = c.required(f"{param}.function", value.get("function"))
    if not isinstance(fn, dict):
        raise c.type_error(f"{param}.function", "an object", fn)
    name = c.required(f"{param}.function.name", fn.get("name"))
    if name not in names:
        known = ", ".join(names) or "none"
        raise c.fail(
            "invalid_value",
            f"{param}.function.name",
            f"{param}.function.name must name a function of body.tools ({known}), got {show(name)}",
        )
    return str(name)


def history_tool_calls(c: Checker, value: Any, p: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the chat template reads them: each call's
    ``function.arguments`` (a JSON string in OpenAI's shape) parsed into an object."""
    if not isinstance(value, list):
        raise c.type_error(p, "an array of tool calls", value)
    calls = []
    for i, call in enumerate(value):
        pc = f"{p}[{i}]"
        if not isinstance(call, dict):
            raise c.type_error(pc, "an object", call)
        kind = call.get("type", "function")
        if kind != "function":
            raise c.fail(
                "invalid_value", f"{pc}.type", f'{pc}.type must be "function", got {show(kind)}'
            )
        fn = c.required(f"{pc}.function", call.get("function"))
        if not isinstance(fn, dict):
            raise c.type_error(f"{pc}.function", "an object", fn)
        name = c.required(f"{pc}.function.name", fn.get("name"))
        if not isinstance(name, str):
            raise c.type_error(f"{pc}.function.name", "a string", name)
        arguments = fn.get("arguments")
        if arguments is None:
            arguments = "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise c.fail(
                    "invalid_value",
                    f"{pc}.function.arguments",
                    f"{pc}.function.arguments must be a JSON object's text, got {show(arguments)}",
                ) from None
        if not isinstance(arguments, dict):
            raise c.type_error(f"{pc}.function.arguments", "a JSON object", arguments)
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        call_id = call.get("id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise c.type_error(f"{pc}.id", "a string", call_id)
            entry["id"] = call_id
        calls.append(entry)
    return calls
