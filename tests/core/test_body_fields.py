"""Each endpoint's accepted body fields, written once (``core.batchfile.bodies.fields``): a
field outside the list refuses the line naming it, every field in it passes, vLLM's extensions
are read into the request, an upstream model's lines keep fields this service does not know,
and the docs list the same fields."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from core.batchfile.bodies import fields
from core.batchfile.bodies.fields import FIELDS
from core.batchfile.reader import RawLine, parse_request, validate_file
from core.batchfile.request import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL
from core.llms.specs import forwarded_models

ROOT = Path(__file__).resolve().parents[2]
URLS = {"chat": CHAT_URL, "completion": COMPLETIONS_URL, "embedding": EMBEDDINGS_URL,
        "response": RESPONSES_URL}  # fmt: skip
REQUIRED: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "Hello"}]},
    "completion": {"prompt": "Once upon a time"},
    "embedding": {"input": "a document"},
    "response": {"input": "Hello"},
}


def line(kind: str, custom_id: str = "r1", model: str = "m1", **body: Any) -> str:
    b = {"model": model, **REQUIRED[kind], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URLS[kind], "body": b})


def parse(kind: str, forwarded: tuple[str, ...] = (), **body: Any):
    data = line(kind, **body).encode()
    return parse_request(
        RawLine(1, 0, len(data) + 1, data),
        endpoint=URLS[kind],
        served_models=["m1", "m2"],
        forwarded=forwarded,
    )


def refusal(kind: str, **body: Any):
    from core.batchfile.request import LineError

    with pytest.raises(LineError) as info:
        parse(kind, **body)
    return info.value


@pytest.mark.parametrize("kind", list(FIELDS))
def test_a_field_outside_the_list_is_named_in_openais_words(kind: str) -> None:
    err = refusal(kind, max_tokns=5)
    assert err.to_dict() == {
        "code": "unknown_parameter",
        "message": "Unrecognized request argument supplied: max_tokns",
        "param": "body.max_tokns",
        "line": 1,
    }


def test_every_unknown_field_is_named_and_long_names_are_cut() -> None:
    err = refusal("chat", zeta=1, alpha=2)
    assert (err.param, err.message) == (
        "body.zeta",
        "Unrecognized request arguments supplied: zeta, alpha",
    )
    err = refusal("chat", **{f"f{i}": i for i in range(7)}, **{"x" * 500: 1})
    assert err.message == (
        "Unrecognized request arguments supplied: f0, f1, f2, f3, f4, and 3 more"
    )
    err = refusal("chat", **{"x" * 500: 1})
    assert err.param == "body." + "x" * 61 + "..."


@pytest.mark.parametrize("kind", list(FIELDS))
def test_every_field_in_the_list_is_accepted(kind: str) -> None:
    """Null is every optional field's default, so a body of every field passes."""
    body = {name: None for name in FIELDS[kind] if name not in ("model", *REQUIRED[kind])}
    req = parse(kind, **body)
    assert req.kind == kind and set(req.body) == set(FIELDS[kind])


def test_the_lists_hold_openais_fields_and_the_engines_extensions() -> None:
    for kind in FIELDS:
        assert len(set(FIELDS[kind])) == len(FIELDS[kind]), f"{kind} names a field twice"
    vllm = {"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "guided_choice", "guided_regex", "guided_json"}  # fmt: skip
    assert vllm <= set(FIELDS["chat"]) and vllm <= set(FIELDS["completion"])
    assert "chat_template_kwargs" in FIELDS["chat"]
    assert "chat_template_kwargs" not in FIELDS["completion"]
    assert not vllm & set(FIELDS["embedding"] + FIELDS["response"])


def test_vllm_extensions_are_read_into_the_request() -> None:
    req = parse(
        "chat",
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.3,
        min_tokens=3,
        max_tokens=8,
        stop_token_ids=[5, 9],
        ignore_eos=True,
        skip_special_tokens=False,
        guided_choice=["yes", "no"],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert (req.top_k, req.min_p, req.repetition_penalty, req.min_tokens) == (20, 0.05, 1.3, 3)
    assert (req.stop_token_ids, req.ignore_eos, req.skip_special_tokens) == ([5, 9], True, False)
    assert (req.choice, req.regex, req.json_schema) == (["yes", "no"], None, None)
    assert req.chat_template_kwargs == {"enable_thinking": False}
    defaults = parse("completion")
    assert (defaults.min_p, defaults.repetition_penalty, defaults.min_tokens) == (0.0, 1.0, 0)
    assert (defaults.stop_token_ids, defaults.skip_special_tokens) == ([], True)
    assert defaults.chat_template_kwargs is None
    assert parse("completion", guided_regex=r"\d+").regex == r"\d+"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse("completion", guided_json=schema).json_schema == schema
    assert parse("chat", guided_json=json.dumps(schema)).json_schema == schema  # vLLM takes text
    assert parse("completion", min_tokens=16).min_tokens == 16  # the completions default


def test_an_upstream_models_line_keeps_the_fields_this_service_does_not_know() -> None:
    """Forwarded as written: the upstream decides what it accepts. The fields this service
    knows are still checked."""
    req = parse("chat", forwarded=("m1",), max_tokns=5, vendor_knob={"x": 1}, min_p=0.2)
    assert req.body["max_tokns"] == 5 and req.body["vendor_knob"] == {"x": 1}
    assert req.min_p == 0.2
    for kind in FIELDS:
        assert parse(kind, forwarded=("m1",), bogus=True).body["bogus"] is True
    from core.batchfile.request import LineError

    with pytest.raises(LineError) as known:
        parse("chat", forwarded=("m1",), bogus=1, temperature=9)
    assert (known.value.code, known.value.param) == ("invalid_value", "body.temperature")
    # another model's lines are checked in full
    with pytest.raises(LineError) as local:
        parse("chat", forwarded=("m2",), bogus=1)
    assert local.value.code == "unknown_parameter"


def test_validation_of_a_file_forwards_only_upstream_models() -> None:
    models = {"local": "demo:llama-tiny", "fleet": "upstream:http://127.0.0.1:9/v1"}
    assert forwarded_models(models) == {"fleet": frozenset()}
    for model, ok in (("fleet", True), ("local", False)):
        data = line("chat", "a", model=model, max_tokns=5) + "\n"
        data += line("chat", "b", model=model, max_tokens=5) + "\n"
        report = validate_file(
            io.BytesIO(data.encode()),
            endpoint=CHAT_URL,
            served_models=list(models),
            max_requests=10,
            forwarded=forwarded_models(models),
        )
        assert report.num_requests == (2 if ok else 1)
        if not ok:
            assert [(e.line, e.code, e.param) for e in report.errors] == [
                (1, "unknown_parameter", "body.max_tokns")
            ]


def _docs_table() -> dict[str, tuple[list[str], list[str]]]:
    """The rows of the body-field table in docs/batch-files.md: endpoint -> (OpenAI's
    fields, extensions), each a list of the backticked names in its cell."""
    text = (ROOT / "docs" / "batch-files.md").read_text()
    section = text.split("## Body fields", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`/v1/"):
            endpoint = cells[0].strip("`")
            rows[endpoint] = tuple(re.findall(r"`([a-z_]+)`", c) for c in cells[1:])
    return rows


def test_the_docs_list_the_fields_of_the_code() -> None:
    table = _docs_table()
    openai = {
        "chat": fields.OPENAI_CHAT,
        "completion": fields.OPENAI_COMPLETIONS,
        "embedding": fields.OPENAI_EMBEDDINGS,
        "response": fields.OPENAI_RESPONSES,
    }
    assert set(table) == set(URLS.values())
    for kind, url in URLS.items():
        documented_openai, documented_extra = table[url]
        assert documented_openai == list(openai[kind]), url
        assert documented_openai + documented_extra == list(FIELDS[kind]), url


def test_openais_fields_are_the_openai_sdks() -> None:
    """Every name the lists give as OpenAI's is a field of the SDK's request parameters (a
    newer SDK may know more; ``stream`` is in its streaming variant)."""
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    def sdk(params: type) -> set[str]:
        return {name for cls in params.__mro__ for name in getattr(cls, "__annotations__", {})}

    for ours, params in (
        (fields.OPENAI_CHAT, chat_params.CompletionCreateParamsStreaming),
        (fields.OPENAI_COMPLETIONS, completion_create_params.CompletionCreateParamsStreaming),
        (fields.OPENAI_EMBEDDINGS, embedding_create_params.EmbeddingCreateParams),
        (fields.OPENAI_RESPONSES, response_create_params.ResponseCreateParamsStreaming),
    ):
        assert set(ours) <= sdk(params), sorted(set(ours) - sdk(params))
