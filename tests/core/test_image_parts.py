"""Image content parts: a local (text-only) model refuses the line naming the part; an upstream
model gets it as written; Anthropic image blocks become OpenAI ``image_url`` parts; a ``data:``
URL counts towards the line's byte limit; and no code of the service fetches an image URL."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from core.batchfile.anthropic import UnservableRequest, chat_body
from core.batchfile.reader import RawLine, parse_request, validate_file
from core.batchfile.request import CHAT_URL, LineError

ROOT = Path(__file__).resolve().parents[2]
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()
IMAGE = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}


def request(content: Any, **kw: Any) -> dict[str, Any]:
    return {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT_URL,
        "body": {
            "model": "m",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}],
            **kw,
        },
    }


def parse(obj: dict[str, Any], forwarded: bool = False) -> Any:
    raw = json.dumps(obj).encode()
    return parse_request(
        RawLine(1, 0, len(raw), raw),
        endpoint=CHAT_URL,
        served_models=None,
        forwarded=["m"] if forwarded else (),
    )


def test_a_local_model_refuses_an_image_naming_the_part() -> None:
    with pytest.raises(LineError) as caught:
        parse(request([IMAGE, {"type": "text", "text": "what is it?"}]))
    err = caught.value
    assert (err.line, err.code, err.param) == (
        1,
        "unsupported_value",
        "body.messages[1].content[0]",
    )
    assert "image_url" in err.message and 'model "m" takes text only' in err.message
    with pytest.raises(LineError) as caught:
        parse(request([{"type": "input_audio", "input_audio": {}}]))
    assert caught.value.param == "body.messages[1].content[0].type"


def test_an_upstream_model_gets_the_parts_as_written() -> None:
    content = [{"type": "text", "text": "what is it?"}, IMAGE, {"type": "input_audio"}]
    req = parse(request(content), forwarded=True)
    assert req.body["messages"][1]["content"] == content  # the body goes as written
    assert req.messages[1]["content"] == "what is it?"  # the text, for the token estimate
    with pytest.raises(LineError) as caught:
        parse(request([{"type": "image_url", "image_url": {}}]), forwarded=True)
    assert caught.value.param == "body.messages[1].content[0].image_url.url"


def test_anthropic_image_blocks_become_image_url_parts() -> None:
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.invalid/cat.png"}},
        {"type": "text", "text": "both?"},
    ]
    params = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    assert chat_body(params)["messages"] == [
        {
            "role": "user",
            "content": [
                IMAGE,
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
                {"type": "text", "text": "both?"},
            ],
        }
    ]
    bad = dict(blocks[0], source={"type": "base64", "media_type": "text/plain", "data": "eA=="})
    with pytest.raises(UnservableRequest) as caught:
        chat_body(dict(params, messages=[{"role": "user", "content": [bad]}]))
    assert caught.value.param == "params.messages[0].content[0].source.media_type"


def test_a_data_url_counts_towards_the_line_byte_limit() -> None:
    limit = 4096
    small = json.dumps(request([IMAGE])).encode() + b"\n"
    big_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * limit}}
    big = json.dumps(request([big_image])).encode() + b"\n"
    assert len(small) < limit < len(big)
    report = validate_file(
        [small, big],
        endpoint=CHAT_URL,
        served_models=None,
        max_requests=10,
        max_line_bytes=limit,
        forwarded=["m"],
    )
    (err,) = report.errors
    assert (err.line, err.code) == (2, "line_too_long")
    assert f"Line 2 is {len(big)} bytes, over the limit of {limit} bytes" in err.message


# No code of the service fetches an image URL: the modules that read image parts import no
# HTTP client, and no other product module mentions them.

HTTP_CLIENTS = {"httpx", "requests", "urllib", "aiohttp", "http", "urllib3", "socket"}
PRODUCT = ("api", "core", "worker", "engine", "cli")


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_code_path_fetches_an_image_url() -> None:
    readers = sorted(
        str(path.relative_to(ROOT))
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if "image_url" in path.read_text(encoding="utf-8")
        or '"image"' in path.read_text(encoding="utf-8")
    )
    assert readers == [
        "core/batchfile/anthropic.py",
        "core/batchfile/bodies/fields.py",
        "core/batchfile/bodies/generation.py",
    ]
    for reader in readers:
        assert not imports(ROOT / reader) & HTTP_CLIENTS, reader


def test_a_responses_line_forwards_images_and_items_to_an_upstream_model() -> None:
    from core.batchfile.request import RESPONSES_URL

    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what?"},
                {"type": "input_image", "image_url": "https://example.invalid/a.png"},
            ],
        },
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
    ]
    obj = {
        "custom_id": "a",
        "method": "POST",
        "url": RESPONSES_URL,
        "body": {"model": "m", "input": items},
    }
    raw = json.dumps(obj).encode()
    for forwarded, param in ((True, None), (False, "body.input[0].content[1].type")):
        try:
            req = parse_request(
                RawLine(1, 0, len(raw), raw),
                endpoint=RESPONSES_URL,
                served_models=None,
                forwarded=["m"] if forwarded else (),
            )
        except LineError as err:
            assert err.param == param
        else:
            assert param is None and req.body["input"] == items
            assert req.messages is not None and req.messages[0]["content"] == "what?"
