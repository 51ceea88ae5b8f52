"""Structured output requests: OpenAI's ``response_format`` (chat, and completions as an
extension) and the Responses API's ``text.format``, read into one JSON Schema.

``{"type": "text"}`` (or nothing) is free text; ``{"type": "json_object"}`` any JSON object
(the schema ``{"type": "object"}``); ``json_schema`` the schema given. A schema is checked
here, at validation, with the grammar compiler the engine uses (llguidance): a keyword it
cannot enforce (``uniqueItems``, ``if``/``then``, ``not``, …) refuses the line with an error
that names the keyword, so no request is accepted that the engine could not keep valid.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from core.batch_request import show
from core.bodies.checker import Checker

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
