"""Batch output format: response bodies and output/error lines in OpenAI's shapes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from core.batchfile.reader import RawLine, parse_request
from core.batchfile.request import CHAT_URL, COMPLETIONS_URL, BatchRequest
from core.batchfile.results import (
    ChoiceResult,
    GenerationResult,
    TokenLogprobInfo,
    batch_error_line,
    chat_completion_body,
    completion_body,
    dumps_line,
    output_line,
    request_error_line,
    response_body,
)

USAGE_KEYS = {
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
}


def request(url: str = CHAT_URL, **body: Any) -> BatchRequest:
    b: dict[str, Any] = {"model": "m1"}
    if url == CHAT_URL:
        b["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        b["prompt"] = "Hi"
    b.update(body)
    data = json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": b}).encode()
    return parse_request(RawLine(1, 0, len(data) + 1, data), endpoint=url, served_models=None)


def result(logprobs: bool = False) -> GenerationResult:
    lp = None
    if logprobs:
        lp = [
            TokenLogprobInfo("Hel", -0.1, None, [("Hel", -0.1, None), ("He", -2.5, [72, 101])]),
            TokenLogprobInfo(
                "lo", -math.inf, [108, 111], [("lo", -math.inf, None), ("p", -3.0, None)]
            ),
        ]
    return GenerationResult(
        prompt_tokens=7,
        cached_tokens=4,
        choices=[
            ChoiceResult(index=1, text="Bye", finish_reason="length", completion_tokens=3),
            ChoiceResult(
                index=0, text="Hello", finish_reason="stop", completion_tokens=2, logprobs=lp
            ),
        ],
    )


def test_chat_completion_body_shape() -> None:
    req = request(n=2)
    body = chat_completion_body(req, result(), completion_id="chatcmpl-x", created=123)
    assert set(body) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    }
    assert (body["id"], body["object"], body["created"], body["model"]) == (
        "chatcmpl-x",
        "chat.completion",
        123,
        "m1",
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]  # sorted by index
    c0 = body["choices"][0]
    assert set(c0) == {"index", "message", "logprobs", "finish_reason"}
    assert c0["message"] == {
        "role": "assistant",
        "content": "Hello",
        "refusal": None,
        "annotations": [],
    }
    assert c0["logprobs"] is None and c0["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_a_stop_string_that_ended_a_choice_is_its_stop_reason() -> None:
    stopped = GenerationResult(
        prompt_tokens=3,
        cached_tokens=0,
        choices=[ChoiceResult(0, "Hel", "stop", 2, stop_reason="lo")],
    )
    chat = chat_completion_body(request(stop=["lo"]), stopped)
    assert chat["choices"][0]["stop_reason"] == "lo"  # vLLM's field
    assert ChatCompletion.model_validate(chat).choices[0].finish_reason == "stop"
    legacy = completion_body(request(COMPLETIONS_URL, stop=["lo"]), stopped)
    assert legacy["choices"][0]["stop_reason"] == "lo"
    assert "stop_reason" not in chat_completion_body(request(), result())["choices"][0]


def test_chat_completion_defaults() -> None:
    body = chat_completion_body(request(), result())
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > len("chatcmpl-")
    assert isinstance(body["created"], int) and body["created"] > 1_600_000_000
    assert body["model"] == "m1"
    other = chat_completion_body(request(), result(), model="served-name", system_fingerprint="fp")
    assert other["model"] == "served-name" and other["system_fingerprint"] == "fp"
    assert other["id"] != body["id"]


def test_chat_logprobs() -> None:
    req = request(logprobs=True, top_logprobs=1)
    body = chat_completion_body(req, result(logprobs=True))
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert lp["content"] == [
        {
            "token": "Hel",
            "logprob": -0.1,
            "bytes": [72, 101, 108],
            "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]}],
        },
        {
            "token": "lo",
            "logprob": -9999.0,
            "bytes": [108, 111],
            "top_logprobs": [{"token": "lo", "logprob": -9999.0, "bytes": [108, 111]}],
        },
    ]
    assert body["choices"][1]["logprobs"] is None  # the engine gave none for that choice
    ChatCompletion.model_validate(body)
    json.loads(dumps_line(body))  # -inf did not leak into the JSON
    # Not requested: not written, even if the engine computed them.
    assert chat_completion_body(request(), result(logprobs=True))["choices"][0]["logprobs"] is None


def test_completion_body_shape_and_logprobs() -> None:
    req = request(COMPLETIONS_URL, logprobs=2)
    body = completion_body(req, result(logprobs=True), completion_id="cmpl-x", created=5)
    assert set(body) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    }
    assert (body["id"], body["object"], body["created"]) == ("cmpl-x", "text_completion", 5)
    c0 = body["choices"][0]
    assert set(c0) == {"text", "index", "logprobs", "finish_reason"}
    assert c0["text"] == "Hello"
    assert c0["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.1, -9999.0],
        "top_logprobs": [{"Hel": -0.1, "He": -2.5}, {"lo": -9999.0, "p": -3.0}],
        "text_offset": [0, 3],
    }
    assert set(body["usage"]) == USAGE_KEYS
    Completion.model_validate(body)
    assert completion_body(request(COMPLETIONS_URL), result())["id"].startswith("cmpl-")
    zero = completion_body(request(COMPLETIONS_URL, logprobs=0), result(logprobs=True))
    assert zero["choices"][0]["logprobs"]["top_logprobs"] == [{}, {}]
    Completion.model_validate(zero)


def test_response_body_dispatches_on_kind() -> None:
    assert response_body(request(), result())["object"] == "chat.completion"
    assert response_body(request(COMPLETIONS_URL), result())["object"] == "text_completion"


def test_output_line_shape() -> None:
    body = chat_completion_body(request(), result())
    line = output_line("c1", body, request_id="req_1")
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_")
    assert line["custom_id"] == "c1" and line["error"] is None
    assert line["response"] == {"status_code": 200, "request_id": "req_1", "body": body}
    auto = output_line("c1", body)
    assert auto["response"]["request_id"].startswith("req_") and auto["id"] != line["id"]


def test_request_error_line_shape() -> None:
    line = request_error_line(
        "c2",
        status_code=400,
        message="prompt too long",
        code="context_length_exceeded",
        param="body.messages",
    )
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["error"] is None and line["custom_id"] == "c2"
    resp = line["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and resp["status_code"] == 400
    assert resp["body"] == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "param": "body.messages",
            "code": "context_length_exceeded",
        }
    }
    server = request_error_line(
        "c3", status_code=500, message="boom", code=None, type="server_error"
    )
    assert server["response"]["body"]["error"]["type"] == "server_error"
    assert server["response"]["body"]["error"]["param"] is None


@pytest.mark.parametrize(
    ("code", "words"),
    [("batch_expired", "completion window expired"), ("batch_cancelled", "cancelled")],
)
def test_batch_error_line(code: str, words: str) -> None:
    line = batch_error_line("c4", code)
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["response"] is None
    assert set(line["error"]) == {"code", "message"} and line["error"]["code"] == code
    assert words in line["error"]["message"]


def test_batch_error_line_other_codes_need_a_message() -> None:
    assert batch_error_line("c", "batch_failed", "worker lost")["error"]["message"] == "worker lost"
    with pytest.raises(ValueError):
        batch_error_line("c", "batch_failed")


def test_dumps_line() -> None:
    obj = {"custom_id": "é✓", "n": [1, 2], "x": None}
    data = dumps_line(obj)
    assert data == '{"custom_id":"é✓","n":[1,2],"x":null}\n'.encode()
    assert data.count(b"\n") == 1 and json.loads(data) == obj
    # Text with newlines stays on one line.
    assert dumps_line({"t": "a\nb\r\n"}).count(b"\n") == 1
    # A lone surrogate (legal via a JSON escape in the input) round-trips, as valid UTF-8.
    weird = {"custom_id": "a\ud800b"}
    data = dumps_line(weird)
    data.decode("utf-8")
    assert json.loads(data) == weird
    with pytest.raises(ValueError):
        dumps_line({"x": math.nan})


def test_embedding_body_is_openais_shape() -> None:
    import base64
    import struct

    from openai.types import CreateEmbeddingResponse

    from core.batchfile.reader import RawLine, parse_request
    from core.batchfile.results import embedding_body

    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m", "input": ["a", "b"]}}  # fmt: skip
    raw = RawLine(1, 0, 1, json.dumps(line).encode())
    req = parse_request(raw, endpoint="/v1/embeddings", served_models=None)
    vectors = [[0.5, -1.0, 0.25], [1.0, 0.0, 2.0]]
    body = embedding_body(req, vectors, prompt_tokens=7)
    parsed = CreateEmbeddingResponse.model_validate(body)
    assert [d.embedding for d in parsed.data] == vectors
    assert [d.index for d in parsed.data] == [0, 1]
    assert (parsed.object, parsed.usage.prompt_tokens, parsed.usage.total_tokens) == ("list", 7, 7)

    req.encoding_format = "base64"
    body = embedding_body(req, vectors, prompt_tokens=7)
    decoded = [list(struct.unpack("<3f", base64.b64decode(d["embedding"]))) for d in body["data"]]
    assert decoded == vectors
