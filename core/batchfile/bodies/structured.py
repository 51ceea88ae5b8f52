"""Structured output requests, read into one constraint: OpenAI's ``response_format`` and the
Responses API's ``text.format`` into a JSON Schema; vLLM's ``guided_json``, ``guided_regex``
and ``guided_choice`` into the schema, a regular expression or a list of strings. One request
asks for one of them at most.

A schema or expression is compiled here, at validation, by the engine's grammar compiler
(llguidance): what it cannot enforce refuses the line, naming the keyword, so no request is
accepted that the engine could not keep valid."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from core.batchfile.bodies.checker import Checker
from core.batchfile.request import BatchRequest, show

FORMAT_TYPES = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(text)
    except ValueError as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` cannot constrain decoding (``Unimplemented keys: ["uniqueItems"]``,
    ``Invalid type: …``), or None. Cached: a file of many lines usually repeats one schema."""
    return _schema_problem(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=256)
def regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot constrain decoding (a syntax error, a look-around), or None."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_regex(pattern)
    except ValueError as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    # "at 1(8): invalid regex …: regex parse error: <the pattern> error: <why> <the grammar>"
    lines = [line.strip() for line in messages[0].splitlines()]
    return next((line for line in lines if line.startswith("error:")), lines[0])


GUIDED = ("guided_json", "guided_regex", "guided_choice")


def guided(c: Checker, req: BatchRequest) -> None:
    """vLLM's ``guided_json`` (a JSON Schema, or its JSON text), ``guided_regex`` and
    ``guided_choice`` into ``req``; read after ``response_format`` (``req.json_schema``),
    since a request may ask for one kind of structured output only."""
    given = [name for name in GUIDED if c.get(name) is not None]
    if not given:
        return
    if len(given) > 1 or req.json_schema is not None:
        other = given[0] if len(given) > 1 else "response_format"
        raise c.fail(
            "invalid_value",
            f"body.{given[-1]}",
            f"body.{given[-1]} cannot be combined with body.{other}: a request asks for one "
            "kind of structured output",
        )
    name = given[0]
    param = f"body.{name}"
    value = c.get(name)
    if name == "guided_json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise c.fail(
                    "invalid_value", param, f"{param} must be a JSON Schema, got {show(value)}"
                ) from None
        if not isinstance(schema, dict):
            raise c.type_error(param, "an object (a JSON Schema)", value)
        problem = schema_problem(schema)
        if problem is not None:
            raise c.fail(
                "unsupported_value",
                param,
                f"{param} cannot be enforced by this service: {problem}",
            )
        req.json_schema = schema
    elif name == "guided_regex":
        if not isinstance(value, str):
            raise c.type_error(param, "a string", value)
        if not value:
            raise c.fail("invalid_value", param, f"{param} must not be empty")
        problem = regex_problem(value)
        if problem is not None:
            raise c.fail(
                "unsupported_value", param, f"{param} cannot be enforced by this service: {problem}"
            )
        req.regex = value
    else:
        if not isinstance(value, list):
            raise c.type_error(param, "an array of strings", value)
        if not value:
            raise c.fail("invalid_value", param, f"{param} must not be empty")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise c.type_error(f"{param}[{i}]", "a string", item)
            if not item:
                raise c.fail("invalid_value", f"{param}[{i}]", f"{param}[{i}] must not be empty")
        req.choice = list(value)


def json_schema(c: Checker, fmt: Any, param: str, *, flat: bool) -> dict[str, Any] | None:
    """The JSON Schema a format object asks for, or None for free text.

    ``flat``: the Responses API's shape, where ``name``/``schema``/``strict`` sit beside
    ``type``; otherwise chat's, where they sit in ``json_schema``."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise c.type_error(param, "an object", fmt)
    kind = c.choice(f"{param}.type", c.required(f"{param}.type", fmt.get("type")), FORMAT_TYPES)
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    spec, where = (fmt, param) if flat else (fmt.get("json_schema"), f"{param}.json_schema")
    if spec is None:
        raise c.fail("missing_required_param", where, f"{where} is required for json_schema")
    if not isinstance(spec, dict):
        raise c.type_error(where, "an object", spec)
    name = c.required(f"{where}.name", spec.get("name"))
    if not isinstance(name, str) or not _NAME.match(name):
        raise c.fail(
            "invalid_value",
            f"{where}.name",
            f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {show(name)}",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise c.type_error(f"{where}.strict", "a boolean", strict)
    schema = spec.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise c.type_error(f"{where}.schema", "an object (a JSON Schema)", schema)
    problem = schema_problem(schema)
    if problem is not None:
        raise c.fail(
            "unsupported_value",
            f"{where}.schema",
            f"{where}.schema cannot be enforced by this service: {problem}",
        )
    return schema
