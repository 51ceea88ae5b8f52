"""NaN and infinities in Messages params: JSON has neither, Python's parser reads them, and
each is that request's own error naming the field (never the whole create's)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from core.batchfile.anthropic import UnservableRequest, chat_body

BASE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("change", "param", "shown"),
    [
        ({"top_k": math.nan}, "params.top_k", "NaN"),
        ({"top_k": math.inf}, "params.top_k", "Infinity"),
        ({"stop_sequences": ["x", -math.inf]}, "params.stop_sequences[1]", "-Infinity"),
        ({"temperature": math.nan}, "params.temperature", "NaN"),
        ({"max_tokens": math.inf}, "params.max_tokens", "Infinity"),
        ({"metadata": {"score": math.nan}}, "params.metadata.score", "NaN"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a", "w": math.nan}]}
                ]
            },
            "params.messages[0].content[0].w",
            "NaN",
        ),
    ],
)
def test_a_non_finite_number_is_the_requests_error_naming_the_field(
    change: dict[str, Any], param: str, shown: str
) -> None:
    with pytest.raises(UnservableRequest) as caught:
        chat_body({**BASE, **change})
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: {shown} is not a number JSON allows")


def test_what_pythons_parser_reads_is_caught() -> None:
    """The route's parser (json.loads) turns these into floats; every one is refused."""
    for text in ("NaN", "Infinity", "-Infinity", "1e999"):
        params = json.loads(f'{{"model": "m", "max_tokens": 5, "top_k": {text}, '
                            '"messages": [{"role": "user", "content": "hi"}]}')  # fmt: skip
        with pytest.raises(UnservableRequest, match="params.top_k"):
            chat_body(params)
    assert chat_body({**BASE, "top_k": 1e300, "temperature": 0.5})["top_k"] == 1e300  # finite
