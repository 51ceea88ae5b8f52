"""Messages params as chat bodies, and chat result lines as Anthropic results (pure functions;
the anthropic SDK runs them end to end in tests/e2e/test_anthropic_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from core.batchfile.anthropic import UnservableRequest, chat_body, messages_param, result_of
from core.batchfile.results import batch_error_line, request_error_line

BASE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def test_params_map_onto_a_chat_body() -> None:
    body = chat_body(
        {
            **BASE,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "stop_sequences": ["x"],
            "top_k": 3,
            "temperature": 0.5,
            "metadata": {"user_id": "u"},
        }
    )
    assert body == {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}],
        "temperature": 0.5,
        "top_k": 3,
        "stop": ["x"],
    }


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"name": "f", "type": "web_search_20250305"}]}, "params.tools[0].type"),
        ({"max_tokens": 0}, "params.max_tokens"),
        ({"temperature": 1.5}, "params.temperature"),  # Anthropic's range is 0 to 1
        ({"stream": True}, "params.stream"),
        ({"top_n": 2}, "params.top_n"),
        ({"messages": [{"role": "system", "content": "x"}]}, "params.messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "params.messages[0].content[0].source.type",
        ),
    ],
)
def test_what_cannot_be_served_names_the_field(change: dict, param: str) -> None:
    with pytest.raises(UnservableRequest) as caught:
        chat_body({**BASE, **change})
    assert caught.value.param == param and caught.value.message.startswith(param)


def test_result_lines_become_anthropic_results() -> None:
    assert result_of(batch_error_line("a", "batch_expired")) == {"type": "expired"}
    assert result_of(batch_error_line("a", "batch_cancelled")) == {"type": "canceled"}
    failed = result_of(request_error_line("a", message="too long", code="x", param="body.stop"))
    assert failed["type"] == "errored"
    assert failed["error"]["error"]["type"] == "invalid_request_error"
    assert failed["error"]["error"]["message"] == "params.stop_sequences: too long"
    line = {
        "custom_id": "a",
        "response": {
            "status_code": 200,
            "body": {
                "model": "m",
                "choices": [{"message": {"content": "hey"}, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 5,
                    "prompt_tokens_details": {"cached_tokens": 4},
                },
            },
        },
    }
    message = result_of(line)["message"]
    assert message["content"] == [{"type": "text", "text": "hey"}]
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"] == {
        "input_tokens": 6,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    assert messages_param("body.max_completion_tokens") == "params.max_tokens"
    assert (message["stop_reason"], message["stop_sequence"]) == ("max_tokens", None)


def test_a_stop_sequence_that_ended_a_message_is_named() -> None:
    def ended(choice: dict[str, Any]) -> dict[str, Any]:
        body = {"model": "m", "choices": [{"message": {"content": "hi"}, **choice}]}
        line = {"custom_id": "a", "response": {"status_code": 200, "body": body}}
        return result_of(line)["message"]

    by_string = ended({"finish_reason": "stop", "stop_reason": "\n\nHuman:"})
    assert (by_string["stop_reason"], by_string["stop_sequence"]) == ("stop_sequence", "\n\nHuman:")
    by_eos = ended({"finish_reason": "stop"})
    assert (by_eos["stop_reason"], by_eos["stop_sequence"]) == ("end_turn", None)
    by_token = ended({"finish_reason": "stop", "stop_reason": 7})  # a stop token id
    assert (by_token["stop_reason"], by_token["stop_sequence"]) == ("end_turn", None)
