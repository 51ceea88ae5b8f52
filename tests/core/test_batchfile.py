"""Batch input format: line reading, per-line validation, whole-file validation."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from core.batchfile.reader import RawLine, iter_lines, parse_request, validate_file
from core.batchfile.request import CHAT_URL, COMPLETIONS_URL, BatchRequest, LineError

MODELS = ["m1", "m2"]


def chat_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "Hello"}]}
    b.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": b}


def completion_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m1", "prompt": "Once upon a time"}
    b.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": b}


def raw(obj: Any, line: int = 1) -> RawLine:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return RawLine(line=line, offset=0, length=len(data) + 1, data=data)


def parse(obj: Any, endpoint: str | None = None, served=MODELS) -> BatchRequest:
    if endpoint is None:
        endpoint = obj.get("url", CHAT_URL) if isinstance(obj, dict) else CHAT_URL
        if not isinstance(endpoint, str) or endpoint not in (CHAT_URL, COMPLETIONS_URL):
            endpoint = CHAT_URL
    return parse_request(raw(obj), endpoint=endpoint, served_models=served)


def error_of(obj: Any, **kw: Any) -> LineError:
    with pytest.raises(LineError) as info:
        parse(obj, **kw)
    return info.value


def jsonl(*objs: Any) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def validate(data: bytes, **kw: Any):
    opts: dict[str, Any] = {
        "endpoint": CHAT_URL,
        "served_models": MODELS,
        "max_requests": 100,
        "max_line_bytes": 10_000,
    }
    opts.update(kw)
    return validate_file(io.BytesIO(data), **opts)


# --------------------------------------------------------------------------------------------
# iter_lines


def lines_of(data: bytes, max_line_bytes: int = 1000, chunk_size: int = 7) -> list[RawLine]:
    return list(iter_lines(io.BytesIO(data), max_line_bytes=max_line_bytes, chunk_size=chunk_size))


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 64, 1 << 16])
def test_iter_lines_offsets_reread_exactly(chunk_size: int) -> None:
    data = b'\xef\xbb\xbf{"a":1}\r\n\n   \r\n{"b":"\xc3\xa9"}\n\n{"c":3}'
    got = lines_of(data, chunk_size=chunk_size)
    assert [(r.line, r.data) for r in got] == [
        (1, b'{"a":1}'),
        (4, b'{"b":"\xc3\xa9"}'),
        (6, b'{"c":3}'),
    ]
    assert got[0].offset == 3  # after the BOM
    stream = io.BytesIO(data)
    for r in got:
        stream.seek(r.offset)
        chunk = stream.read(r.length)
        assert chunk.rstrip(b"\r\n") == r.data
        assert len(chunk) == r.length
    assert got[0].length == len(b'{"a":1}\r\n')
    assert got[-1].offset + got[-1].length == len(data)  # final line without newline


def test_iter_lines_accepts_chunk_iterables_and_ranges() -> None:
    data = jsonl({"a": 1}, {"b": 2}, {"c": 3}, {"d": 4})
    all_lines = lines_of(data)
    second, fourth = all_lines[1], all_lines[3]
    start, end = second.offset, fourth.offset  # lines 2..3
    chunks = [data[i : min(i + 5, end)] for i in range(start, end, 5)]
    ranged = list(iter_lines(iter(chunks), max_line_bytes=100, first_line=2, base_offset=start))
    assert [(r.line, r.offset, r.length, r.data) for r in ranged] == [
        (r.line, r.offset, r.length, r.data) for r in all_lines[1:3]
    ]


def test_iter_lines_bom_only_at_file_start() -> None:
    data = b"\xef\xbb\xbfx\n\xef\xbb\xbfy\n"
    got = lines_of(data)
    assert [r.data for r in got] == [b"x", b"\xef\xbb\xbfy"]
    # A range starting mid-file keeps a leading BOM-looking sequence as data.
    got = list(iter_lines(io.BytesIO(data[5:]), max_line_bytes=100, base_offset=5, first_line=2))
    assert got[0].data == b"\xef\xbb\xbfy"


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 1 << 16])
def test_iter_lines_over_long_line_is_skipped_not_buffered(chunk_size: int) -> None:
    long = b"x" * 5000
    data = b"ok1\n" + long + b"\nok2\r\n" + b"y" * 21 + b"\r\n" + b"z" * 20 + b"\r\n" + long
    got = lines_of(data, max_line_bytes=20, chunk_size=chunk_size)
    assert [(r.line, r.too_long, r.data) for r in got] == [
        (1, False, b"ok1"),
        (2, True, b""),
        (3, False, b"ok2"),
        (4, True, b""),
        (5, False, b"z" * 20),  # exactly the limit: the "\r" does not count
        (6, True, b""),  # final line without a newline
    ]
    assert got[1].offset == 4 and got[1].length == 5001
    assert got[3].length == 23
    assert got[5].offset + got[5].length == len(data)


def test_iter_lines_memory_is_bounded_for_huge_lines() -> None:
    class Endless(io.RawIOBase):
        """A 64 MiB line of "a" then one short line, generated on the fly."""

        def __init__(self) -> None:
            self.left = 64 << 20
            self.tail = b'\n{"x":1}\n'

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            if self.left:
                k = min(n, self.left)
                self.left -= k
                return b"a" * k
            out, self.tail = self.tail[:n], self.tail[n:]
            return out

    got = list(iter_lines(Endless(), max_line_bytes=1024, chunk_size=1 << 20))
    assert [(r.line, r.too_long, r.data) for r in got] == [(1, True, b""), (2, False, b'{"x":1}')]
    assert got[0].length == (64 << 20) + 1


def test_iter_lines_empty_and_blank_only() -> None:
    assert lines_of(b"") == []
    assert lines_of(b"\n\r\n  \t\n") == []
    assert lines_of(b"\xef\xbb\xbf") == []


# --------------------------------------------------------------------------------------------
# parse_request: the happy paths


def test_parse_chat_normalises() -> None:
    obj = chat_line(
        "abc",
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            },
            {"role": "assistant", "content": "ok", "name": "bot"},
            {"role": "developer", "content": ""},
        ],
        max_tokens=10,
        max_completion_tokens=20,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        n=2,
        stop="END",
        seed=7,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=-2,
        frequency_penalty=1.5,
        ignore_eos=True,
        user="someone",
        metadata={"x": 1},
        response_format={"type": "text"},
        stream=False,
        tool_choice="none",
        tools=[],
    )
    req = parse(obj)
    assert req.kind == "chat" and req.custom_id == "abc" and req.model == "m1"
    assert req.url == CHAT_URL and req.body == obj["body"]
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "A\nB"},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "developer", "content": ""},
    ]
    assert req.prompt is None
    assert req.max_tokens == 20  # max_completion_tokens wins
    assert (req.temperature, req.top_p, req.top_k, req.n) == (0.0, 0.5, 0, 2)
    assert req.stop == ["END"] and req.seed == 7
    assert req.logprobs is True and req.top_logprobs == 3
    assert (req.presence_penalty, req.frequency_penalty, req.ignore_eos) == (-2.0, 1.5, True)


def test_parse_chat_defaults_and_nulls() -> None:
    req = parse(chat_line(temperature=None, top_p=None, stop=None, seed=None, n=None))
    assert req.max_tokens is None
    assert (req.temperature, req.top_p, req.top_k, req.n, req.stop, req.seed) == (
        1.0,
        1.0,
        0,
        1,
        [],
        None,
    )
    assert (req.logprobs, req.top_logprobs, req.presence_penalty, req.frequency_penalty) == (
        False,
        0,
        0.0,
        0.0,
    )
    assert req.ignore_eos is False
    assert parse(chat_line(max_tokens=5)).max_tokens == 5
    assert parse(chat_line(max_tokens=5.0)).max_tokens == 5
    assert parse(chat_line(stop=["a", "b", "c", "d"])).stop == ["a", "b", "c", "d"]
    assert parse(chat_line(top_k=40)).top_k == 40


def test_parse_completion() -> None:
    req = parse(completion_line(max_tokens=3, logprobs=2, echo=False, best_of=1, suffix=None))
    assert req.kind == "completion" and req.prompt == "Once upon a time" and req.messages is None
    assert req.max_tokens == 3 and req.logprobs is True and req.top_logprobs == 2
    assert parse(completion_line(logprobs=0)).logprobs is True
    assert parse(completion_line()).logprobs is False
    assert parse(completion_line(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    assert parse(completion_line(prompt=["only one"])).prompt == "only one"
    assert parse(completion_line(prompt=[[5, 6]])).prompt == [5, 6]


def test_served_models_none_skips_model_check() -> None:
    assert parse(chat_line(model="anything"), served=None).model == "anything"


# --------------------------------------------------------------------------------------------
# parse_request: the malformed corpus


def _with(obj: dict[str, Any], **top: Any) -> dict[str, Any]:
    out = dict(obj)
    for k, v in top.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()

LINE_CASES: list[tuple[str, Any, str, str | None]] = [
    # (case, line, code, param)
    ("invalid utf-8", b'{"custom_id": "\xff\xfe"}', "invalid_encoding", None),
    ("not json", b"{not json", "invalid_json_line", None),
    ("truncated json", b'{"custom_id": "a"', "invalid_json_line", None),
    ("NaN", b'{"custom_id": NaN}', "invalid_json_line", None),
    ("array", b"[1, 2]", "invalid_json_line", None),
    ("string", b'"hello"', "invalid_json_line", None),
    ("deep", b"[" * 10_000 + b"]" * 10_000, "invalid_json_line", None),
    ("deep object", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "invalid_json_line", None),
    ("no custom_id", _with(chat_line(), custom_id=_DROP), "missing_custom_id", "custom_id"),
    ("null custom_id", _with(chat_line(), custom_id=None), "missing_custom_id", "custom_id"),
    ("int custom_id", _with(chat_line(), custom_id=5), "invalid_custom_id", "custom_id"),
    ("empty custom_id", _with(chat_line(), custom_id=""), "invalid_custom_id", "custom_id"),
    ("long custom_id", _with(chat_line(), custom_id="x" * 513), "invalid_custom_id", "custom_id"),
    ("no method", _with(chat_line(), method=_DROP), "invalid_method", "method"),
    ("GET", _with(chat_line(), method="GET"), "invalid_method", "method"),
    ("post lowercase", _with(chat_line(), method="post"), "invalid_method", "method"),
    ("no url", _with(chat_line(), url=_DROP), "invalid_url", "url"),
    ("unknown url", _with(chat_line(), url="/v1/moderations"), "invalid_url", "url"),
    ("url not a string", _with(chat_line(), url=["/v1/chat/completions"]), "invalid_url", "url"),
    ("no body", _with(chat_line(), body=_DROP), "missing_required_param", "body"),
    ("body list", _with(chat_line(), body=[]), "invalid_type", "body"),
    ("no model", chat_line(model=None), "missing_required_param", "body.model"),
    ("model int", chat_line(model=3), "invalid_type", "body.model"),
    ("unknown model", chat_line(model="gpt-4o"), "model_not_found", "body.model"),
    # chat body
    (
        "no messages",
        _with(chat_line(), body={"model": "m1"}),
        "missing_required_param",
        "body.messages",
    ),
    ("messages str", chat_line(messages="hi"), "invalid_type", "body.messages"),
    ("messages empty", chat_line(messages=[]), "invalid_value", "body.messages"),
    ("message not obj", chat_line(messages=["hi"]), "invalid_type", "body.messages[0]"),
    (
        "no role",
        chat_line(messages=[{"content": "x"}]),
        "missing_required_param",
        "body.messages[0].role",
    ),
    (
        "bad role",
        chat_line(messages=[{"role": "robot", "content": "x"}]),
        "invalid_value",
        "body.messages[0].role",
    ),
    (
        "role int",
        chat_line(messages=[{"role": 1, "content": "x"}]),
        "invalid_type",
        "body.messages[0].role",
    ),
    (
        "no content",
        chat_line(messages=[{"role": "user"}]),
        "missing_required_param",
        "body.messages[0].content",
    ),
    (
        "content int",
        chat_line(messages=[{"role": "user", "content": 5}]),
        "invalid_type",
        "body.messages[0].content",
    ),
    (
        "image part",
        chat_line(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        "unsupported_value",
        "body.messages[0].content[0]",
    ),
    (
        "text part without text",
        chat_line(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "invalid_type",
        "body.messages[0].content[0].text",
    ),
    (
        "part not obj",
        chat_line(messages=[{"role": "user", "content": ["x"]}]),
        "invalid_type",
        "body.messages[0].content[0]",
    ),
    (
        "second message bad",
        chat_line(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": None}]),
        "missing_required_param",
        "body.messages[1].content",
    ),
    (
        "tool calls",
        chat_line(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]),
        "missing_required_param",
        "body.messages[0].tool_calls[0].function",
    ),
    (
        "name int",
        chat_line(messages=[{"role": "user", "content": "a", "name": 1}]),
        "invalid_type",
        "body.messages[0].name",
    ),
    ("max_tokens 0", chat_line(max_tokens=0), "invalid_value", "body.max_tokens"),
    ("max_tokens str", chat_line(max_tokens="10"), "invalid_type", "body.max_tokens"),
    ("max_tokens bool", chat_line(max_tokens=True), "invalid_type", "body.max_tokens"),
    ("max_tokens frac", chat_line(max_tokens=1.5), "invalid_type", "body.max_tokens"),
    ("mct 0", chat_line(max_completion_tokens=0), "invalid_value", "body.max_completion_tokens"),
    ("temperature high", chat_line(temperature=3.5), "invalid_value", "body.temperature"),
    ("temperature neg", chat_line(temperature=-0.1), "invalid_value", "body.temperature"),
    ("temperature str", chat_line(temperature="hot"), "invalid_type", "body.temperature"),
    ("temperature bool", chat_line(temperature=True), "invalid_type", "body.temperature"),
    ("top_p 0", chat_line(top_p=0), "invalid_value", "body.top_p"),
    ("top_p high", chat_line(top_p=1.01), "invalid_value", "body.top_p"),
    ("top_k -2", chat_line(top_k=-2), "invalid_value", "body.top_k"),
    ("top_k float", chat_line(top_k=1.5), "invalid_type", "body.top_k"),
    ("n 0", chat_line(n=0), "invalid_value", "body.n"),
    ("n 129", chat_line(n=129), "invalid_value", "body.n"),
    ("stop int", chat_line(stop=5), "invalid_type", "body.stop"),
    ("stop too many", chat_line(stop=["a", "b", "c", "d", "e"]), "invalid_value", "body.stop"),
    ("stop item int", chat_line(stop=["a", 1]), "invalid_type", "body.stop[1]"),
    ("stop empty", chat_line(stop=[""]), "invalid_value", "body.stop[0]"),
    ("seed str", chat_line(seed="1"), "invalid_type", "body.seed"),
    ("seed huge", chat_line(seed=2**70), "invalid_value", "body.seed"),
    ("logprobs int", chat_line(logprobs=1), "invalid_type", "body.logprobs"),
    (
        "top_logprobs high",
        chat_line(logprobs=True, top_logprobs=21),
        "invalid_value",
        "body.top_logprobs",
    ),
    ("top_logprobs no logprobs", chat_line(top_logprobs=2), "invalid_value", "body.top_logprobs"),
    ("presence high", chat_line(presence_penalty=2.5), "invalid_value", "body.presence_penalty"),
    ("frequency low", chat_line(frequency_penalty=-3), "invalid_value", "body.frequency_penalty"),
    ("ignore_eos str", chat_line(ignore_eos="yes"), "invalid_type", "body.ignore_eos"),
    ("stream", chat_line(stream=True), "unsupported_value", "body.stream"),
    ("stream str", chat_line(stream="yes"), "invalid_type", "body.stream"),
    (
        "tools",
        chat_line(tools=[{"type": "function", "function": {"name": "f g"}}]),
        "invalid_value",
        "body.tools[0].function.name",
    ),
    ("functions", chat_line(functions=[{"name": "f"}]), "unsupported_parameter", "body.functions"),
    ("tool_choice", chat_line(tool_choice="auto"), "invalid_value", "body.tool_choice"),
    ("logit_bias", chat_line(logit_bias={"5": 10}), "unsupported_parameter", "body.logit_bias"),
    (
        "response_format type",
        chat_line(response_format={"type": "xml"}),
        "invalid_value",
        "body.response_format.type",
    ),
    (
        "json_schema unsupported keyword",
        chat_line(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
            }
        ),
        "unsupported_value",
        "body.response_format.json_schema.schema",
    ),
    (
        "json_schema without name",
        chat_line(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        "missing_required_param",
        "body.response_format.json_schema.name",
    ),
    (
        "response_format str",
        chat_line(response_format="json"),
        "invalid_type",
        "body.response_format",
    ),
    ("audio", chat_line(modalities=["text", "audio"]), "unsupported_value", "body.modalities"),
]
LINE_CASES += [
    # 1e400 parses to inf: must not slip through the range check.
    (
        "temperature inf",
        b'{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m1","messages":[{"role":"user","content":"x"}],"temperature":1e400}}',
        "invalid_value",
        "body.temperature",
    ),
    # completions body
    (
        "no prompt",
        _with(completion_line(), body={"model": "m1"}),
        "missing_required_param",
        "body.prompt",
    ),
    ("prompt int", completion_line(prompt=5), "invalid_type", "body.prompt"),
    ("prompt empty", completion_line(prompt=""), "invalid_value", "body.prompt"),
    ("prompt empty list", completion_line(prompt=[]), "invalid_value", "body.prompt"),
    ("two prompts", completion_line(prompt=["a", "b"]), "unsupported_value", "body.prompt"),
    ("two token prompts", completion_line(prompt=[[1], [2]]), "unsupported_value", "body.prompt"),
    ("token str", completion_line(prompt=[1, "a"]), "invalid_type", "body.prompt[1]"),
    ("token neg", completion_line(prompt=[1, -1]), "invalid_value", "body.prompt[1]"),
    ("nested token bad", completion_line(prompt=[[1, 2.5]]), "invalid_type", "body.prompt[0][1]"),
    ("echo", completion_line(echo=True), "unsupported_value", "body.echo"),
    ("suffix", completion_line(suffix="end"), "unsupported_parameter", "body.suffix"),
    ("best_of", completion_line(best_of=3), "unsupported_value", "body.best_of"),
    ("logprobs 6", completion_line(logprobs=6), "invalid_value", "body.logprobs"),
    ("logprobs bool", completion_line(logprobs=True), "invalid_type", "body.logprobs"),
    ("completion stream", completion_line(stream=True), "unsupported_value", "body.stream"),
    ("completion max_tokens", completion_line(max_tokens=-5), "invalid_value", "body.max_tokens"),
    (
        "completion messages are chat's field",
        _with(completion_line(), body={"model": "m1", "messages": []}),
        "unknown_parameter",
        "body.messages",
    ),
    ("completion prompt missing", _with(completion_line(), body={"model": "m1"}),
     "missing_required_param", "body.prompt"),
    # fields no endpoint knows, named before anything else is checked
    ("typo", chat_line(max_tokns=5), "unknown_parameter", "body.max_tokns"),
    ("typo completion", completion_line(temprature=0), "unknown_parameter", "body.temprature"),
    ("typo before bad value", chat_line(temperature=9, bogus=1), "unknown_parameter", "body.bogus"),
    ("chat field on completions", completion_line(max_completion_tokens=5), "unknown_parameter",
     "body.max_completion_tokens"),
    ("chat_template_kwargs on completions", completion_line(chat_template_kwargs={}),
     "unknown_parameter", "body.chat_template_kwargs"),
    # vLLM's extensions, checked
    ("min_p high", chat_line(min_p=1.5), "invalid_value", "body.min_p"),
    ("min_p str", chat_line(min_p="0.1"), "invalid_type", "body.min_p"),
    ("repetition_penalty 0", chat_line(repetition_penalty=0), "invalid_value",
     "body.repetition_penalty"),
    ("min_tokens neg", chat_line(min_tokens=-1), "invalid_value", "body.min_tokens"),
    ("min_tokens over max_tokens", chat_line(min_tokens=6, max_tokens=5), "invalid_value",
     "body.min_tokens"),
    ("min_tokens over the completions default", completion_line(min_tokens=17),
     "invalid_value", "body.min_tokens"),
    ("stop_token_ids int", chat_line(stop_token_ids=5), "invalid_type", "body.stop_token_ids"),
    ("stop_token_ids neg", chat_line(stop_token_ids=[1, -2]), "invalid_value",
     "body.stop_token_ids[1]"),
    ("skip_special_tokens str", chat_line(skip_special_tokens="no"), "invalid_type",
     "body.skip_special_tokens"),
    ("guided_choice empty", chat_line(guided_choice=[]), "invalid_value", "body.guided_choice"),
    ("guided_choice item", chat_line(guided_choice=["a", 1]), "invalid_type",
     "body.guided_choice[1]"),
    ("guided_regex look-ahead", chat_line(guided_regex="(?=a)b"), "unsupported_value",
     "body.guided_regex"),
    ("guided_json keyword", completion_line(guided_json={"type": "array", "uniqueItems": True}),
     "unsupported_value", "body.guided_json"),
    ("guided_json text", chat_line(guided_json="{not json"), "invalid_value", "body.guided_json"),
    ("guided_json array", chat_line(guided_json=[1]), "invalid_type", "body.guided_json"),
    ("two guided", chat_line(guided_regex="a+", guided_choice=["a"]), "invalid_value",
     "body.guided_choice"),
    ("guided and response_format", chat_line(guided_regex="a+",
     response_format={"type": "json_object"}), "invalid_value", "body.guided_regex"),
    ("chat_template_kwargs list", chat_line(chat_template_kwargs=[1]), "invalid_type",
     "body.chat_template_kwargs"),
    ("chat_template_kwargs call argument", chat_line(chat_template_kwargs={"tokenize": True}),
     "invalid_value", "body.chat_template_kwargs.tokenize"),
    ("function_call", chat_line(function_call={"name": "f"}), "unsupported_parameter",
     "body.function_call"),
    ("moderation", chat_line(moderation={"m": 1}), "unsupported_parameter", "body.moderation"),
    ("web_search_options", chat_line(web_search_options={"search_context_size": "low"}),
     "unsupported_parameter", "body.web_search_options"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "line", "code", "param"), LINE_CASES, ids=[c[0] for c in LINE_CASES]
)
def test_line_errors(case: str, line: Any, code: str, param: str | None) -> None:
    endpoint = None
    if isinstance(line, bytes):
        endpoint = CHAT_URL
    err = error_of(line, endpoint=endpoint)
    assert (err.code, err.param, err.line) == (code, param, 1), err.message
    assert err.to_dict() == {"code": code, "message": err.message, "param": param, "line": 1}
    assert err.message


def test_mismatched_url() -> None:
    err = error_of(completion_line(), endpoint=CHAT_URL)
    assert (err.code, err.param) == ("mismatched_url", "url")
    assert CHAT_URL in err.message and COMPLETIONS_URL in err.message


def test_messages_name_limit_and_value() -> None:
    assert error_of(chat_line(temperature=3.5)).message == (
        "body.temperature must be between 0 and 2, got 3.5"
    )
    assert "between 1 and 128, got 129" in error_of(chat_line(n=129)).message
    assert "at most 4" in error_of(chat_line(stop=list("abcde"))).message
    assert "got 5" in error_of(chat_line(stop=list("abcde"))).message
    assert "at most 512" in error_of(_with(chat_line(), custom_id="x" * 513)).message
    assert "'gpt-4o'" in error_of(chat_line(model="gpt-4o")).message.replace('"', "'")
    assert "got string" in error_of(chat_line(max_tokens="10")).message
    assert "nested too deeply" in error_of(b"[" * 10_000, endpoint=CHAT_URL).message


def test_line_too_long_via_parse_request() -> None:
    r = RawLine(line=7, offset=100, length=5001, data=b"", too_long=True)
    with pytest.raises(LineError) as info:
        parse_request(r, endpoint=CHAT_URL, served_models=None, max_line_bytes=4096)
    assert (info.value.code, info.value.line) == ("line_too_long", 7)
    assert "4096" in info.value.message and "5001" in info.value.message


# --------------------------------------------------------------------------------------------
# validate_file


def test_validate_file_ok_and_callback() -> None:
    data = (
        b"\xef\xbb\xbf"
        + jsonl(chat_line("a"), chat_line("b", max_tokens=3)).replace(b"\n", b"\r\n")
        + b"\n\n"
        + json.dumps(chat_line("c")).encode()
    )
    seen: list[BatchRequest] = []
    report = validate(data, on_request=seen.append)
    assert report.ok and report.errors == [] and report.num_more_errors == 0
    assert report.num_requests == 3 and report.model == "m1" and report.num_invalid == 0
    assert [(r.custom_id, r.line) for r in seen] == [("a", 1), ("b", 2), ("c", 5)]
    # Offsets let the shard task re-read each request exactly.
    for r in seen:
        chunk = data[r.offset : r.offset + r.length]
        assert json.loads(chunk)["custom_id"] == r.custom_id
        assert chunk.endswith(b"\n") or r.offset + r.length == len(data)


def test_validate_file_malformed_corpus() -> None:
    long_line = json.dumps(chat_line("long", messages=[{"role": "user", "content": "x" * 40_000}]))
    data = jsonl(
        chat_line("a"),  # 1
        b"\xff\xfe garbage",  # 2
        b"",  # 3 (blank: skipped)
        long_line.encode(),  # 4
        b"[" * 10_000 + b"]" * 10_000,  # 5
        chat_line("a"),  # 6 duplicate of line 1
        _with(chat_line("u"), url="/v1/moderations"),  # 7
        completion_line("v"),  # 8 mismatches the endpoint
        chat_line("w", model="nope"),  # 9
        chat_line("x", stream=True),  # 10
        chat_line("y", model="m2"),  # 11 a served model, but not the batch's
        chat_line("z", temperature=9),  # 12
        chat_line("ok"),  # 13
    )
    seen: list[str] = []
    report = validate(data, max_line_bytes=30_000, on_request=lambda r: seen.append(r.custom_id))
    got = [(e.line, e.code, e.param) for e in report.errors]
    assert got == [
        (2, "invalid_encoding", None),
        (4, "line_too_long", None),
        (5, "invalid_json_line", None),
        (6, "duplicate_custom_id", "custom_id"),
        (7, "invalid_url", "url"),
        (8, "mismatched_url", "url"),
        (9, "model_not_found", "body.model"),
        (10, "unsupported_value", "body.stream"),
        (11, "mismatched_model", "body.model"),
        (12, "invalid_value", "body.temperature"),
    ]
    assert seen == ["a", "ok"]
    assert report.num_requests == 2 and report.num_invalid == 10 and not report.ok
    dup = report.errors[3].message
    assert "line 6" in dup and "line 1" in dup
    mm = report.errors[8].message
    assert "m2" in mm and "m1" in mm and "line 1" in mm
    assert "30000" in report.errors[1].message  # the limit is named
    assert report.error_dicts()[0] == {
        "code": "invalid_encoding",
        "message": report.errors[0].message,
        "param": None,
        "line": 2,
    }


def test_validate_file_max_errors() -> None:
    data = jsonl(*[b"nope"] * 10, chat_line("a"))
    report = validate(data, max_errors=3)
    assert [e.line for e in report.errors] == [1, 2, 3]
    assert report.num_more_errors == 7 and report.num_errors == 10
    assert report.num_requests == 1


def test_validate_file_too_many_requests_stops() -> None:
    data = jsonl(*[chat_line(f"r{i}") for i in range(10)])
    calls: list[int] = []
    report = validate(data, max_requests=4, on_request=lambda r: calls.append(r.line))
    assert calls == [1, 2, 3, 4]
    assert [(e.line, e.code) for e in report.errors] == [(5, "too_many_requests")]
    assert "4" in report.errors[0].message
    assert report.truncated and not report.ok
    # Exactly at the limit is fine; blank lines do not count.
    data = jsonl(*[chat_line(f"r{i}") for i in range(4)]) + b"\n\n\n"
    assert validate(data, max_requests=4).ok


@pytest.mark.parametrize("data", [b"", b"\n\n", b"\xef\xbb\xbf", b"  \r\n\t\n"])
def test_validate_file_empty(data: bytes) -> None:
    report = validate(data)
    assert [(e.line, e.code) for e in report.errors] == [(None, "empty_file")]
    assert report.error_dicts() == [
        {"code": "empty_file", "message": report.errors[0].message, "param": None, "line": None}
    ]
    assert report.num_requests == 0 and report.model is None


def test_validate_file_completions_endpoint_and_models_none() -> None:
    data = jsonl(completion_line("a", model="whatever"), completion_line("b", model="whatever"))
    report = validate(data, endpoint=COMPLETIONS_URL, served_models=None)
    assert report.ok and report.model == "whatever" and report.num_requests == 2


def test_validate_file_callback_errors_propagate() -> None:
    def boom(req: BatchRequest) -> None:
        raise RuntimeError("tokenizer down")

    with pytest.raises(RuntimeError, match="tokenizer down"):
        validate(jsonl(chat_line("a")), on_request=boom)


def test_validate_file_from_chunk_iterable() -> None:
    data = jsonl(chat_line("a"), chat_line("b"))
    chunks = (data[i : i + 3] for i in range(0, len(data), 3))
    report = validate_file(
        chunks, endpoint=CHAT_URL, served_models=MODELS, max_requests=10, max_line_bytes=1000
    )
    assert report.ok and report.num_requests == 2


def test_reparse_shard_range_matches_validation() -> None:
    """The shard task's path: re-read a byte range and parse each line again."""
    objs = [chat_line(f"r{i}", temperature=i / 10) for i in range(6)]
    data = b"\xef\xbb\xbf" + jsonl(*objs[:3]) + b"\r\n" + jsonl(*objs[3:])
    reqs: list[BatchRequest] = []
    assert validate(data, on_request=reqs.append).ok
    start, end = reqs[2].offset, reqs[4].offset + reqs[4].length
    again = [
        parse_request(r, endpoint=CHAT_URL, served_models=None)
        for r in iter_lines(
            io.BytesIO(data[start:end]),
            max_line_bytes=10_000,
            first_line=reqs[2].line,
            base_offset=start,
        )
    ]
    assert again == reqs[2:5]


# --------------------------------------------------------------------------------------------
# The endpoint a file targets (read by `batchd submit` before uploading)


def _jsonl(*objs: Any) -> io.BytesIO:
    return io.BytesIO(b"".join(json.dumps(o).encode() + b"\n" for o in objs))


def test_file_endpoint_from_first_url() -> None:
    from core.batchfile.reader import file_endpoint

    completion = {**chat_line("c"), "url": COMPLETIONS_URL}
    assert file_endpoint(_jsonl(completion, completion)) == (COMPLETIONS_URL, 1)
    # Lines without a usable url are left to validation; the first one that has one counts.
    stream = io.BytesIO(b"not json\n" + json.dumps({"url": 7}).encode() + b"\n")
    stream = io.BytesIO(stream.getvalue() + json.dumps(chat_line()).encode() + b"\n")
    assert file_endpoint(stream) == (CHAT_URL, 3)
    assert file_endpoint(io.BytesIO(b"")) is None


def test_file_endpoint_refuses_a_mixed_file() -> None:
    from core.batchfile.reader import file_endpoint

    completion = {**chat_line("c"), "url": COMPLETIONS_URL}
    with pytest.raises(LineError) as info:
        file_endpoint(_jsonl(chat_line("a"), chat_line("b"), completion))
    err = info.value
    assert (err.line, err.code, err.param) == (3, "mixed_endpoints", "url")
    assert COMPLETIONS_URL in err.message and "line 1" in err.message


# --------------------------------------------------------------------------------------------
# Embeddings lines


def embedding_line(custom_id: str = "e1", **body: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m1", "input": "Hello"}
    b.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": b}


def parse_embedding(obj: dict[str, Any]) -> BatchRequest:
    raw = RawLine(1, 0, 1, json.dumps(obj).encode())
    return parse_request(raw, endpoint="/v1/embeddings", served_models=MODELS)


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_embedding_inputs(value: Any, inputs: list) -> None:
    req = parse_embedding(embedding_line(input=value, encoding_format="base64", dimensions=64))
    assert (req.kind, req.inputs, req.encoding_format, req.dimensions) == (
        "embedding",
        inputs,
        "base64",
        64,
    )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": None}, "body.input", "body.input is required"),
        ({"input": []}, "body.input", "must not be an empty array"),
        ({"input": ["a", ""]}, "body.input[1]", "body.input[1] must not be an empty string"),
        ({"input": [[1], [2, -1]]}, "body.input[1][1]", "must be a token id"),
        ({"input": ["a", 3]}, "body.input[1]", "a string or an array of token ids"),
        ({"input": ["x"] * 2049}, "body.input", "at most 2048 inputs, got 2049"),
        ({"input": {"a": 1}}, "body.input", "must be a string, an array of strings"),
        ({"encoding_format": "int8"}, "body.encoding_format", "one of float, base64"),
        ({"dimensions": 0}, "body.dimensions", "at least 1"),
        ({"user": 5}, "body.user", "must be a string"),
    ],
)
def test_embedding_errors_name_the_field(body: dict, param: str, message: str) -> None:
    with pytest.raises(LineError) as info:
        parse_embedding(embedding_line(**body))
    assert info.value.param == param and message in info.value.message, info.value
