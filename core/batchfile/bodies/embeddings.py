"""The body of ``/v1/embeddings``."""

from __future__ import annotations

from core.batchfile.bodies.checker import Checker
from core.batchfile.request import ENCODING_FORMATS, MAX_EMBEDDING_INPUTS, BatchRequest, show


def check_embedding(c: Checker, req: BatchRequest) -> None:
    body = c.body
    if body.get("input") is None:
        raise c.fail(
            "missing_required_param", "body.input", "body.input is required for embeddings"
        )
    value = body["input"]
    param = "body.input"
    if isinstance(value, str) or (
        isinstance(value, list) and value and not isinstance(value[0], str | list)
    ):
        value = [value]  # one text, or one token array
        index = False
    elif isinstance(value, list):
        index = True
    else:
        raise c.type_error(param, "a string, an array of strings or of token-id arrays", value)
    if not value:
        raise c.fail("invalid_value", param, f"{param} must not be an empty array")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise c.fail(
            "invalid_value",
            param,
            f"{param} may hold at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}",
        )
    inputs: list[str | list[int]] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]" if index else param
        if isinstance(item, str):
            if not item:
                raise c.fail("invalid_value", where, f"{where} must not be an empty string")
        elif isinstance(item, list):
            if not item:
                raise c.fail("invalid_value", where, f"{where} must not be an empty array")
            for j, tok in enumerate(item):
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise c.fail(
                        "invalid_value" if isinstance(tok, int) else "invalid_type",
                        f"{where}[{j}]",
                        f"{where}[{j}] must be a token id (an integer of at least 0), got {show(tok)}",
                    )
            item = list(item)
        else:
            raise c.type_error(where, "a string or an array of token ids", item)
        inputs.append(item)
    req.inputs = inputs
    fmt = body.get("encoding_format")
    if fmt is not None:
        c.choice("body.encoding_format", fmt, ENCODING_FORMATS)
    req.encoding_format = fmt or "float"
    req.dimensions = c.integer("dimensions", 1, None, None)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise c.type_error("body.user", "a string", user)
