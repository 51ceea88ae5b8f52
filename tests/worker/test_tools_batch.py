"""Tools in chat lines through a batch's real validation, shard run (the engine on the tiny demo
model, whose chat template renders tools as Hermes and Qwen2.5 do) and finalize, on real
Postgres and local storage: a forced call (``tool_choice`` required or named) always parses,
and its arguments validate against the function's schema; ``auto`` output is parsed for calls;
tool calls and tool results in the history are rendered; an upstream model gets tools and
image parts as written, as a loopback upstream server receives them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jsonschema
import pytest

from testkit.builders.worker import (
    MODEL,
    batch_row,
    chat_line,
    make_batch,
    read_file_lines,
    shard_rows,
)

pytestmark = pytest.mark.services

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "search": SEARCH}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": s}}
    for name, s in SCHEMAS.items()
]


def run_batch(lines: list[dict[str, Any]], host: Any) -> tuple[list[dict], list[dict]]:
    """Validate, run every shard on ``host`` and finalize; the output and error lines."""
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard

    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress", batch_row(batch_id).errors
    for shard in shard_rows(batch_id):
        run_shard(shard.id, host=host)
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    return read_file_lines(batch.output_file_id), read_file_lines(batch.error_file_id)


def assert_valid_calls(message: dict[str, Any], names: set[str]) -> None:
    calls = message["tool_calls"]
    assert calls and message["content"] is None
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])


def test_forced_calls_parse_and_their_arguments_match_the_schema(
    worker_env: dict[str, str], host: Any
) -> None:
    prompts = ["weather in paris?", "add two and three", "find cats", "hello", "what now"]
    lines = [
        chat_line(f"req-{i}", text, 96, tools=TOOLS, tool_choice="required")
        for i, text in enumerate(prompts)
    ] + [
        chat_line(
            f"named-{name}",
            "please",
            96,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            seed=7,
            temperature=1.0,
        )
        for name in SCHEMAS
    ]
    out, errors = run_batch(lines, host)
    assert errors == []
    assert len(out) == len(lines)
    for line in out:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        named = line["custom_id"].removeprefix("named-")
        names = {named} if named in SCHEMAS else set(SCHEMAS)
        assert_valid_calls(choice["message"], names)
        assert len(choice["message"]["tool_calls"]) == 1


def test_auto_output_is_parsed_for_calls(worker_env: dict[str, str], host: Any) -> None:
    """``auto`` leaves the output free; here a guided regex makes the model write one call
    (and, on another line, text that only looks like one), so the parse is what is tested."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    wrong = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    lines = [
        chat_line("call", "add 2 and 3", 64, tools=TOOLS, guided_regex=_literal(call)),
        chat_line("text", "hi", 64, tools=TOOLS, guided_regex=_literal(wrong)),
        chat_line("none", "hi", 4, tools=TOOLS, tool_choice="none"),
    ]
    out, errors = run_batch(lines, host)
    assert errors == []
    by_id = {line["custom_id"]: line["response"]["body"]["choices"][0] for line in out}
    assert by_id["call"]["finish_reason"] == "tool_calls"
    assert_valid_calls(by_id["call"]["message"], {"add"})
    assert json.loads(by_id["call"]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "a": 2,
        "b": 3,
    }
    assert by_id["text"]["finish_reason"] == "stop"
    assert by_id["text"]["message"]["content"] == wrong
    assert "tool_calls" not in by_id["text"]["message"]
    assert "tool_calls" not in by_id["none"]["message"]


def _literal(text: str) -> str:
    from engine.text.structured import regex_literal

    return regex_literal(text)


def test_tool_calls_and_results_in_the_history_are_rendered(
    worker_env: dict[str, str], host: Any
) -> None:
    from core.batchfile.reader import RawLine, parse_request
    from core.llms import generation
    from worker.infra import runtime

    history = [
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    line = chat_line("hist", "", 4, tools=TOOLS)
    line["body"]["messages"] = history
    out, errors = run_batch([line], host)
    assert errors == [] and out[0]["response"]["status_code"] == 200
    raw = json.dumps(line).encode()
    req = parse_request(RawLine(1, 0, len(raw), raw), endpoint=line["url"], served_models=None)
    prompt = generation.chat_prompt(runtime.tokenizer(MODEL), req)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt
    assert '"name": "search"' in prompt  # the functions, in the system turn


def test_anthropic_tools_round_trip(worker_env: dict[str, str], host: Any) -> None:
    """A Messages request with tools and ``tool_choice: any`` as the chat line Anthropic
    batches write, run, and its result as Anthropic's: ``tool_use`` blocks whose input
    matches the tool's ``input_schema``."""
    from core.batchfile.anthropic import chat_body, chat_line, result_of

    params = {
        "model": MODEL,
        "max_tokens": 96,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "weather?"}]}],
        "tools": [
            {"name": name, "description": "a tool", "input_schema": s}
            for name, s in SCHEMAS.items()
        ],
        "tool_choice": {"type": "any"},
    }
    out, errors = run_batch([chat_line("a", chat_body(params))], host)
    assert errors == []
    result = result_of(out[0])
    assert result["type"] == "succeeded"
    message = result["message"]
    assert message["stop_reason"] == "tool_use"
    (block,) = message["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    jsonschema.validate(block["input"], SCHEMAS[block["name"]])


# An upstream model: tools and images go as written.

FLEET = "fleet"


@pytest.fixture
def models(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from core.settings import get_settings

    monkeypatch.setenv(
        "BATCHD_MODELS",
        json.dumps({MODEL: "demo:llama-tiny", FLEET: "upstream:http://127.0.0.1:9/v1?model=big"}),
    )
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


class Recorder(BaseHTTPRequestHandler):
    """A loopback upstream: records each body it is sent and answers with one tool call."""

    def do_POST(self) -> None:
        server: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        server.sent.append(body)
        call = {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        reply = {
            "object": "chat.completion",
            "model": "big",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[Any]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.sent = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_an_upstream_model_gets_tools_and_images_as_written(models: None, upstream: Any) -> None:
    from core.batchfile.anthropic import chat_body, result_of
    from core.batchfile.anthropic import chat_line as anthropic_line
    from core.llms.specs import upstream_spec
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard
    from worker.upstream.dispatcher import Dispatcher

    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    openai = chat_line(
        "openai",
        "",
        model=FLEET,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    openai["body"]["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}
    ]
    params = {
        "model": FLEET,
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
                    },
                    {
                        "type": "image",
                        "source": {"type": "url", "url": "https://example.invalid/a"},
                    },
                ],
            }
        ],
        "tools": [{"name": "add", "input_schema": ADD}],
        "tool_choice": {"type": "tool", "name": "add"},
    }
    lines = [openai, anthropic_line("anthropic", chat_body(params))]
    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress", batch_row(batch_id).errors
    url = f"http://127.0.0.1:{upstream.server_address[1]}/v1"
    dispatcher = Dispatcher(FLEET, upstream_spec(f"upstream:{url}?model=big", FLEET), shared=False)
    dispatcher.start()
    try:
        for shard in shard_rows(batch_id):
            run_shard(shard.id, host=dispatcher)
    finally:
        dispatcher.shutdown()
    assert finalize(batch_id) == "completed"
    assert len(upstream.sent) == 2
    sent = {json.dumps(b["messages"]): b for b in upstream.sent}
    first = sent[json.dumps(openai["body"]["messages"])]
    for name in ("tools", "tool_choice", "parallel_tool_calls", "messages"):
        assert first[name] == openai["body"][name]
    second = next(b for b in upstream.sent if b is not first)
    assert second["tools"] == [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    assert second["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert second["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/a"}},
            ],
        }
    ]
    out = {o["custom_id"]: o for o in read_file_lines(batch_row(batch_id).output_file_id)}
    result = result_of(out["anthropic"])
    assert result["message"]["stop_reason"] == "tool_use"
    assert result["message"]["content"][0]["name"] == "add"


def test_a_local_model_refuses_an_image_naming_the_part(models: None) -> None:
    from worker.batches.tasks import validate

    line = chat_line("a", "")
    line["body"]["messages"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]
    batch_id = make_batch([line])
    assert validate(batch_id) == "failed"
    (error,) = batch_row(batch_id).errors
    assert error["param"] == "body.messages[1].content[0]" and error["line"] == 1
    assert "image_url" in error["message"] and f'"{MODEL}" takes text only' in error["message"]


# A local model whose chat template renders no tools (SmolLM2-135M-Instruct's kind).

PLAIN = "plain"


@pytest.fixture
def plain_model(
    worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> Iterator[Any]:
    """The tiny model with ChatML that never reads ``tools``, served as ``plain``, and an
    engine host on it."""
    import shutil

    from core.llms.demo import build
    from core.settings import get_settings
    from engine import Engine, EngineHost

    path = tmp_path / "plain"
    shutil.copytree(build("llama-tiny"), path)
    (path / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({PLAIN: str(path)}))
    get_settings.cache_clear()
    host = EngineHost(Engine(str(path))).start()
    yield host
    host.shutdown(wait=True, abort_pending=True, timeout=30)
    get_settings.cache_clear()


def test_a_model_whose_template_renders_no_tools_refuses_the_line(plain_model: Any) -> None:
    lines = [
        chat_line("tools", "hi", model=PLAIN, tools=TOOLS, tool_choice="required"),
        chat_line("none", "hi", model=PLAIN, tools=TOOLS, tool_choice="none"),
        chat_line("plain", "hi", model=PLAIN),
    ]
    out, errors = run_batch(lines, plain_model)
    assert sorted(o["custom_id"] for o in out) == ["none", "plain"]
    (line,) = errors
    error = line["response"]["body"]["error"]
    assert line["custom_id"] == "tools" and line["response"]["status_code"] == 400
    assert (error["code"], error["param"]) == ("unsupported_parameter", "body.tools")
    assert f"model '{PLAIN}'" in error["message"] and "does not support tools" in error["message"]
