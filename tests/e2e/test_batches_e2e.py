"""End to end: the official ``openai`` client against the API, with real workers running the
tiny demo model. Upload, create, poll, download; errors, cancel, expiry, live counts."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from testkit.builders.lines import MODEL, chat_line, completion_line, jsonl, request_line

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _submit(stack, lines, endpoint: str = "/v1/chat/completions", window: str = "24h"):
    f = stack.client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return stack.client.batches.create(
        input_file_id=f.id, endpoint=endpoint, completion_window=window
    )


def _wait(stack, batch_id: str, timeout: float, until=lambda b: b.status in TERMINAL):
    deadline = time.monotonic() + timeout
    while True:
        batch = stack.client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(
                f"batch {batch_id} is {batch.status} after {timeout}s: {batch}\n"
                + stack.log("control")[-3000:]
                + stack.log("model")[-3000:]
            )
        time.sleep(0.2)


def _download(stack, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = stack.client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def llm():
    from core.llms.demo import build
    from engine import LLM

    return LLM(str(build("llama-tiny")), dtype="float32")  # as the stack's engine


def test_chat_batch_matches_the_engine_and_reports_per_request_errors(stack, llm):
    from engine import SamplingParams

    texts = [f"hello world number {i}, please write a summary" for i in range(10)]
    lines = [chat_line(f"chat-{i}", t, 6 + i) for i, t in enumerate(texts)]
    lines.insert(4, chat_line("too-long", "the cat " * 700, 8))  # longer than the context (1024)
    batch = _submit(stack, lines)
    assert batch.status == "validating"
    batch = _wait(stack, batch.id, 90)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 11
    assert (batch.request_counts.completed, batch.request_counts.failed) == (10, 1)

    out = _download(stack, batch.output_file_id)
    assert [r["custom_id"] for r in out] == [f"chat-{i}" for i in range(10)]
    expected = llm.chat(
        [[{"role": "user", "content": t}] for t in texts],
        [SamplingParams(max_tokens=6 + i, temperature=0) for i in range(10)],
        use_tqdm=False,
    )
    for record, want in zip(out, expected, strict=True):
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == want.outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)

    (err,) = _download(stack, batch.error_file_id)
    assert err["custom_id"] == "too-long"
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_completions_batch_matches_the_engine(stack, llm):
    from engine import SamplingParams

    prompts = [f"The quick brown fox {i} jumps over" for i in range(8)]
    batch = _submit(
        stack,
        [completion_line(f"c-{i}", p, 10) for i, p in enumerate(prompts)],
        endpoint="/v1/completions",
    )
    batch = _wait(stack, batch.id, 90)
    assert batch.status == "completed", batch
    assert batch.error_file_id is None
    out = _download(stack, batch.output_file_id)
    expected = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert [r["custom_id"] for r in out] == [f"c-{i}" for i in range(8)]
    for record, want in zip(out, expected, strict=True):
        assert record["response"]["body"]["object"] == "text_completion"
        assert record["response"]["body"]["choices"][0]["text"] == want.outputs[0].text
    assert batch.usage is None or batch.usage.output_tokens == sum(
        len(w.outputs[0].token_ids) for w in expected
    )


VERDICT = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


def test_structured_chat_outputs_validate_and_free_text_is_unchanged(stack, llm):
    import jsonschema

    from engine import SamplingParams

    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True},
    }
    lines = [
        chat_line(f"json-{i}", f"classify message {i}", 60, response_format=fmt) for i in range(6)
    ]
    lines += [chat_line("object", "any object", 60, response_format={"type": "json_object"})]
    lines += [chat_line(f"free-{i}", f"free text {i}", 8) for i in range(3)]
    batch = _wait(stack, _submit(stack, lines).id, 120)
    assert batch.status == "completed", batch
    out = {r["custom_id"]: r["response"]["body"] for r in _download(stack, batch.output_file_id)}
    assert len(out) == 10
    for i in range(6):
        choice = out[f"json-{i}"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), VERDICT)
        else:  # cut by max_tokens before the JSON closed, as OpenAI reports it
            assert choice["finish_reason"] == "length"
    assert sum(out[f"json-{i}"]["choices"][0]["finish_reason"] == "stop" for i in range(6)) >= 4
    obj = out["object"]["choices"][0]
    assert obj["finish_reason"] == "length" or isinstance(
        json.loads(obj["message"]["content"]), dict
    )
    expected = llm.chat(
        [[{"role": "user", "content": f"free text {i}"}] for i in range(3)],
        SamplingParams(max_tokens=8, temperature=0),
        use_tqdm=False,
    )
    for i, want in enumerate(expected):
        assert out[f"free-{i}"]["choices"][0]["message"]["content"] == want.outputs[0].text


def _response(custom_id: str, **body: Any) -> dict[str, Any]:
    return request_line(custom_id, "/v1/responses", {"model": MODEL, "temperature": 0, **body})


def test_responses_batch_parses_with_the_sdk(stack, llm):
    import jsonschema
    from openai.types.responses import Response

    from engine import SamplingParams

    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    lines = [
        _response("plain", input="Tell me a story", instructions="Be brief", max_output_tokens=9),
        _response(
            "items",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
            max_output_tokens=400,
            metadata={"run": "nightly"},
        ),
        _response(
            "json", input="Classify: win money now", text={"format": fmt}, max_output_tokens=60
        ),
        _response("tools", input="x", tools=[{"type": "function", "name": "f", "parameters": {}}]),
        _response(
            "image",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        ),
    ]
    batch = _wait(stack, _submit(stack, lines, endpoint="/v1/responses").id, 60)
    assert batch.status == "failed", batch  # tools and images are refused at validation
    errors = {(e.line, e.param) for e in batch.errors.data}
    assert errors == {(4, "body.tools"), (5, "body.input[0].content[0].type")}

    batch = _wait(stack, _submit(stack, lines[:3], endpoint="/v1/responses").id, 120)
    assert batch.status == "completed", batch
    out = {r["custom_id"]: r["response"]["body"] for r in _download(stack, batch.output_file_id)}
    resp = {k: Response.model_validate(v) for k, v in out.items()}
    want = llm.chat(
        [
            [
                {"role": "system", "content": "Be brief"},
                {"role": "user", "content": "Tell me a story"},
            ],
            [{"role": "user", "content": "Hi there"}],
        ],
        [
            SamplingParams(max_tokens=9, temperature=0),
            SamplingParams(max_tokens=400, temperature=0),
        ],
        use_tqdm=False,
    )
    plain, items = resp["plain"], resp["items"]
    assert plain.object == "response" and plain.output_text == want[0].outputs[0].text
    assert plain.instructions == "Be brief"
    assert plain.usage.input_tokens == len(want[0].prompt_token_ids)
    assert plain.usage.output_tokens == len(want[0].outputs[0].token_ids)
    if want[0].outputs[0].finish_reason == "length":
        assert plain.status == "incomplete"
        assert plain.incomplete_details.reason == "max_output_tokens"
    assert items.output_text == want[1].outputs[0].text and items.metadata == {"run": "nightly"}
    verdict = resp["json"]
    if verdict.status == "completed":
        jsonschema.validate(json.loads(verdict.output_text), VERDICT)
    assert out["json"]["text"]["format"] == fmt


def test_validation_failure_names_the_lines(stack):
    lines = [
        json.dumps(chat_line("ok-1", "hi", 4)),
        "{not json",
        json.dumps(
            {**chat_line("other-model", "hi", 4), "body": {"model": "nope", "messages": []}}
        ),
        json.dumps(chat_line("ok-1", "duplicate id", 4)),
    ]
    batch = _submit(stack, lines)
    batch = _wait(stack, batch.id, 60)
    assert batch.status == "failed", batch
    errors = [(e.line, e.code) for e in batch.errors.data]
    assert errors == [
        (2, "invalid_json_line"),
        (3, "model_not_found"),
        (4, "duplicate_custom_id"),
    ]
    assert batch.output_file_id is None


def _long_workload(n: int, tokens: int, *, held: str) -> list[dict[str, Any]]:
    """Each shard (16 requests) starts with three quick requests, so results arrive early
    whichever shard the engine takes first; the last request's prompt carries ``held`` (a
    gate's marker): it holds the engine once admitted, so the batch runs until it is
    cancelled or expires however fast the machine."""
    lines = [
        chat_line(
            f"long-{i}", f"write about the river {i}", 12 if i % 16 < 3 else tokens, ignore_eos=True
        )
        for i in range(n)
    ]
    lines[-1] = chat_line(f"long-{n - 1}", f"write about the river {held}", 12, ignore_eos=True)
    return lines


def test_live_counts_then_cancel_keeps_partial_results(stack):
    with stack.gate("live_counts") as gate:  # the last line holds the batch until cancelled
        lines = _long_workload(48, 64, held=gate.marker)
        batch = _submit(stack, lines)
        # request_counts advance while the batch runs.
        running = _wait(stack, batch.id, 90, until=lambda b: b.request_counts.completed >= 1)
        assert running.status == "in_progress", running
        assert 0 < running.request_counts.completed < 48
        later = _wait(
            stack,
            batch.id,
            60,
            until=lambda b: b.request_counts.completed > running.request_counts.completed,
        )
        assert later.status == "in_progress"

        cancelled_at = time.monotonic()
        assert stack.client.batches.cancel(batch.id).status == "cancelling"
        batch = _wait(stack, batch.id, 30)
        took = time.monotonic() - cancelled_at
    assert batch.status == "cancelled", batch
    assert took < 15, f"cancel took {took:.1f}s"

    out = _download(stack, batch.output_file_id)
    err = _download(stack, batch.error_file_id)
    assert len(out) >= later.request_counts.completed
    assert len(out) < 48 and err
    ids = [r["custom_id"] for r in out] + [r["custom_id"] for r in err]
    assert sorted(ids) == sorted(f"long-{i}" for i in range(48))  # exactly one line each
    assert all(r["response"]["body"]["choices"][0]["finish_reason"] == "length" for r in out)
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert batch.request_counts.completed == len(out)


def test_expiry_keeps_finished_results_and_reports_the_rest(stack):
    # The last line holds the engine past the 10 s window, however fast a step is.
    with stack.gate("expiry") as gate:
        batch = _submit(stack, _long_workload(96, 64, held=gate.marker), window="10s")
        batch = _wait(stack, batch.id, 60)
    assert batch.status == "expired", batch
    out = _download(stack, batch.output_file_id)
    err = _download(stack, batch.error_file_id)
    assert err and {r["error"]["code"] for r in err} == {"batch_expired"}
    ids = [r["custom_id"] for r in out] + [r["custom_id"] for r in err]
    assert sorted(ids) == sorted(f"long-{i}" for i in range(96))
    assert len(out) > 0, "some requests finish within the window"
    assert batch.expired_at is not None and batch.expired_at - batch.created_at < 25
