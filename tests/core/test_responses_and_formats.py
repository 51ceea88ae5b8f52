"""/v1/responses bodies and Response objects, and structured-output formats on every
generation endpoint: what is accepted, what is refused (naming the line and field), and the
output shapes, checked with the openai SDK's own models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from core.batchfile.reader import RawLine, parse_request
from core.batchfile.request import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL, BatchRequest, LineError
from core.batchfile.results import ChoiceResult, GenerationResult, response_body
from core.llms.generation import check_prompt, sampling_kwargs

SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0}},
    "required": ["label"],
    "additionalProperties": False,
}


def line(url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "method": "POST", "url": url, "body": {"model": "m1", **body}}


def parse(obj: dict[str, Any], line_no: int = 3) -> BatchRequest:
    data = json.dumps(obj).encode()
    raw = RawLine(line=line_no, offset=0, length=len(data) + 1, data=data)
    return parse_request(raw, endpoint=obj["url"], served_models=["m1"])


def error_of(obj: dict[str, Any]) -> LineError:
    with pytest.raises(LineError) as info:
        parse(obj)
    return info.value


# -- /v1/responses: requests --------------------------------------------------------------------


def test_string_input_and_instructions_become_chat_messages() -> None:
    req = parse(
        line(
            RESPONSES_URL,
            input="Classify: great",
            instructions="Answer in JSON",
            max_output_tokens=40,
            temperature=0.2,
            top_p=0.9,
            metadata={"run": "nightly"},
        )
    )
    assert req.kind == "response"
    assert req.messages == [
        {"role": "system", "content": "Answer in JSON"},
        {"role": "user", "content": "Classify: great"},
    ]
    assert (req.max_tokens, req.temperature, req.top_p) == (40, 0.2, 0.9)
    assert req.json_schema is None


def test_message_items_with_text_parts() -> None:
    req = parse(
        line(
            RESPONSES_URL,
            input=[
                {"role": "developer", "content": "Be brief"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                {"role": "user", "content": "Again"},
            ],
        )
    )
    assert [m["role"] for m in req.messages or []] == ["developer", "user", "assistant", "user"]
    assert req.messages[1]["content"] == "Hi"


def test_text_format_json_schema_is_the_flat_shape() -> None:
    fmt = {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}
    req = parse(line(RESPONSES_URL, input="x", text={"format": fmt}))
    assert req.json_schema == SCHEMA
    assert sampling_kwargs(req, 5, 100)["json_schema"] == SCHEMA
    json_object = parse(line(RESPONSES_URL, input="x", text={"format": {"type": "json_object"}}))
    assert json_object.json_schema == {"type": "object"}


@pytest.mark.parametrize(
    "body, code, param",
    [
        ({}, "missing_required_param", "body.input"),
        ({"input": 5}, "invalid_type", "body.input"),
        ({"input": []}, "invalid_value", "body.input"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "unsupported_value",
            "body.input[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "unsupported_value",
            "body.input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "body.input[0].role"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}]},
            "unsupported_parameter",
            "body.tools",
        ),
        (
            {"input": "x", "previous_response_id": "resp_1"},
            "unsupported_parameter",
            "body.previous_response_id",
        ),
        ({"input": "x", "stream": True}, "unsupported_value", "body.stream"),
        ({"input": "x", "background": True}, "unsupported_value", "body.background"),
        (
            {"input": "x", "reasoning": {"effort": "high"}},
            "unsupported_parameter",
            "body.reasoning",
        ),
        ({"input": "x", "truncation": "auto"}, "unsupported_value", "body.truncation"),
        ({"input": "x", "moderation": {"m": 1}}, "unsupported_parameter", "body.moderation"),
        (
            {"input": "x", "context_management": [{}]},
            "unsupported_parameter",
            "body.context_management",
        ),
        ({"input": "x", "max_tokens": 5}, "unknown_parameter", "body.max_tokens"),
        ({"input": "x", "max_output_tokens": 0}, "invalid_value", "body.max_output_tokens"),
        ({"input": "x", "metadata": {"k": 1}}, "invalid_type", "body.metadata.k"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            "missing_required_param",
            "body.text.format.name",
        ),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "s", "schema": {"not": {}}}},
            },
            "unsupported_value",
            "body.text.format.schema",
        ),
    ],
)
def test_responses_refusals_name_the_line_and_field(body: dict, code: str, param: str) -> None:
    err = error_of(line(RESPONSES_URL, **body))
    assert (err.line, err.code, err.param) == (3, code, param), err


# -- structured output on chat and completions -------------------------------------------------


def test_chat_json_schema_and_json_object() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "x"}]
    assert parse(line(CHAT_URL, messages=msgs, response_format=fmt)).json_schema == SCHEMA
    obj = parse(line(CHAT_URL, messages=msgs, response_format={"type": "json_object"}))
    assert obj.json_schema == {"type": "object"}
    text = parse(line(CHAT_URL, messages=msgs, response_format={"type": "text"}))
    assert text.json_schema is None


def test_completions_take_response_format_as_an_extension() -> None:
    req = parse(line(COMPLETIONS_URL, prompt="x", response_format={"type": "json_object"}))
    assert req.json_schema == {"type": "object"}


@pytest.mark.parametrize(
    "keyword, schema",
    [
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("if", {"type": "object", "if": {"type": "object"}, "then": {}}),
        ("not", {"not": {"type": "string"}}),
        ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
    ],
)
def test_an_unenforceable_schema_keyword_is_named(keyword: str, schema: dict) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    err = error_of(line(CHAT_URL, messages=[{"role": "user", "content": "x"}], response_format=fmt))
    assert err.code == "unsupported_value"
    assert err.param == "body.response_format.json_schema.schema"
    assert keyword in err.message


# -- Response objects ---------------------------------------------------------------------------


def _result(reason: str) -> GenerationResult:
    return GenerationResult(
        prompt_tokens=12,
        cached_tokens=4,
        choices=[
            ChoiceResult(index=0, text='{"label":"a"}', finish_reason=reason, completion_tokens=6)
        ],
    )


def test_response_object_parses_with_the_sdk() -> None:
    fmt = {"type": "json_schema", "name": "v", "schema": SCHEMA, "strict": True}
    req = parse(
        line(
            RESPONSES_URL,
            input="x",
            instructions="be brief",
            max_output_tokens=30,
            metadata={"k": "v"},
            text={"format": fmt},
        )
    )
    body = response_body(req, _result("stop"))
    resp = Response.model_validate(body)
    assert resp.object == "response" and resp.status == "completed"
    assert resp.output_text == '{"label":"a"}'
    assert resp.incomplete_details is None
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        12,
        6,
        18,
    )
    assert resp.usage.input_tokens_details.cached_tokens == 4
    assert resp.instructions == "be brief" and resp.max_output_tokens == 30
    assert resp.metadata == {"k": "v"}
    assert body["text"]["format"] == fmt
    assert body["id"].startswith("resp_") and body["output"][0]["id"].startswith("msg_")


def test_a_cut_response_is_incomplete_for_max_output_tokens() -> None:
    req = parse(line(RESPONSES_URL, input="x", max_output_tokens=6))
    resp = Response.model_validate(response_body(req, _result("length")))
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"


def test_chat_body_of_a_structured_request_still_parses() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
    req = parse(line(CHAT_URL, messages=[{"role": "user", "content": "x"}], response_format=fmt))
    ChatCompletion.model_validate(response_body(req, _result("stop")))


def test_prompt_limits_name_the_responses_fields() -> None:
    from core.llms.generation import PromptError

    req = parse(line(RESPONSES_URL, input="x", max_output_tokens=500))
    with pytest.raises(PromptError) as info:
        check_prompt(req, 10, 100)
    assert info.value.param == "body.max_output_tokens"
    with pytest.raises(PromptError) as info:
        check_prompt(req, 100, 100)
    assert info.value.param == "body.input"
