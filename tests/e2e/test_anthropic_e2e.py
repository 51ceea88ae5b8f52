"""Anthropic's Message Batches through the whole service, with the official ``anthropic`` SDK
unmodified: create, retrieve, list, cancel, delete and results, run by the real workers on the
same pipeline as OpenAI batches (the greedy text equals the chat batch's, line for line)."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from testkit.builders.lines import MODEL, jsonl
from testkit.service.stack import API_KEY

pytestmark = [pytest.mark.services, pytest.mark.slow]

# JSON log lines, so the x-request-id of a create can be found in the workers' lines.
STACK_ENV = {"BATCHD_LOG_FORMAT": "json"}


@pytest.fixture(scope="module")
def claude(stack):
    import anthropic

    root = stack.base_url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=root, api_key=API_KEY, max_retries=0)


def _params(text: Any, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    content = text if isinstance(text, list) else text
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def _ended(stack, claude, batch_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        batch = claude.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{batch_id} is {batch.processing_status} after {timeout}s: {batch}\n"
                + stack.log("control")[-3000:]
            )
        time.sleep(0.2)


def _chat_texts(stack, lines: list[dict[str, Any]]) -> dict[str, str]:
    """The same requests as an OpenAI chat batch: each custom_id's text."""
    client = stack.client
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while batch.status not in {"completed", "failed", "expired", "cancelled"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    return {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}


def test_message_batch_runs_like_a_chat_batch_and_names_what_it_cannot_serve(stack, claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    requests = [
        {"custom_id": "plain", "params": _params("hello world number 1, please")},
        {"custom_id": "image", "params": _params([{"type": "text", "text": "what"}, image])},
        {
            "custom_id": "system-blocks",
            "params": _params(
                [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}],
                system=[{"type": "text", "text": "Be brief."}],
                top_k=5,
                top_p=0.9,
                stop_sequences=["zzzz"],
            ),
        },
        {
            "custom_id": "tools",
            "params": _params("hi", tools=[{"name": "f"}]),  # no input_schema
        },
        {"custom_id": "short", "params": _params("tell me a long story", max_tokens=2)},
        {"custom_id": "no-model", "params": {**_params("hi"), "model": "no-such-model"}},
        {"custom_id": "typo", "params": {**_params("hi"), "max_tokns": 3}},
    ]
    raw = claude.messages.batches.with_raw_response.create(
        requests=requests, extra_headers={"x-request-id": "trace-anthropic-create-1"}
    )
    assert raw.headers["x-request-id"] == "trace-anthropic-create-1"
    assert raw.request_id == "trace-anthropic-create-1"  # the SDK's own accessor
    created = raw.parse()
    assert created.type == "message_batch" and created.id.startswith("msgbatch_")
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 3 and created.request_counts.errored == 4

    ended = _ended(stack, claude, created.id)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (3, 4, 0), counts
    assert ended.ended_at is not None
    assert ended.results_url.startswith("http://127.0.0.1:")  # absolute, as the SDK fetches it

    results = list(claude.messages.batches.results(created.id))
    assert [r.custom_id for r in results] == [r["custom_id"] for r in requests]
    by_id = {r.custom_id: r.result for r in results}
    for name in ("plain", "system-blocks", "short"):
        assert by_id[name].type == "succeeded", by_id[name]
    errors = {name: by_id[name].error.error for name in ("image", "tools", "no-model", "typo")}
    assert all(e.type == "invalid_request_error" for e in errors.values()), errors
    assert "params.messages[0].content[1]" in errors["image"].message  # the model: text only
    assert "params.tools" in errors["tools"].message
    assert "no-such-model" in errors["no-model"].message
    assert "params.max_tokns" in errors["typo"].message

    short = by_id["short"].message
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert short.role == "assistant" and short.content[0].type == "text"
    assert by_id["plain"].message.usage.input_tokens > 0

    # The oracle: the same requests as an OpenAI chat batch give the same greedy text.
    chat = _chat_texts(
        stack,
        [
            {
                "custom_id": "plain",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "max_tokens": 8,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "hello world number 1, please"}],
                },
            },
            {
                "custom_id": "system-blocks",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "max_tokens": 8,
                    "temperature": 0,
                    "top_k": 5,
                    "top_p": 0.9,
                    "stop": ["zzzz"],
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "hello\nthere"},
                    ],
                },
            },
        ],
    )
    for name, text in chat.items():
        assert by_id[name].message.content[0].text == text, name

    # The create's x-request-id reached the workers' lines about the batch it started.
    control = [json.loads(x) for x in stack.log("control").splitlines() if x.startswith("{")]
    assert any(r.get("http_request_id") == "trace-anthropic-create-1" for r in control)


def test_cancel_delete_list_and_the_error_envelope(stack, claude):
    import anthropic
    import httpx
    import openai

    # The last request cannot end before the cancel: it holds the engine once admitted.
    with stack.gate("anthropic_cancel") as gate:
        long = [
            {"custom_id": f"r{i}", "params": _params(f"write a long story number {i}", 64)}
            for i in range(23)
        ]
        long.append({"custom_id": "r23", "params": _params(f"a story {gate.marker}", 64)})
        running = claude.messages.batches.create(requests=long)
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.batches.delete(running.id)
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        cancelling = claude.messages.batches.cancel(running.id)
        assert cancelling.processing_status in {"canceling", "ended"}
        assert cancelling.cancel_initiated_at is not None
        ended = _ended(stack, claude, running.id)
    counts = ended.request_counts
    assert counts.canceled > 0, counts
    assert counts.succeeded + counts.errored + counts.canceled + counts.expired == 24
    results = list(claude.messages.batches.results(running.id))
    assert [r.custom_id for r in results] == [f"r{i}" for i in range(24)]
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.cancel(running.id)  # it has ended

    listed = {b.id for b in stack.client.batches.list(limit=100)}
    deleted = claude.messages.batches.delete(running.id)
    assert (deleted.id, deleted.type) == (running.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.batches.retrieve(running.id)
    assert missing.value.body["error"]["type"] == "not_found_error"
    gone = listed - {b.id for b in stack.client.batches.list(limit=100)}
    assert len(gone) == 1  # the batch that ran it went with it, not left in /v1/batches
    with pytest.raises(openai.NotFoundError):
        stack.client.batches.retrieve(gone.pop())

    # Batches with nothing to run end at once; pages walk both ways.
    made = [
        claude.messages.batches.create(
            requests=[{"custom_id": "x", "params": {**_params("hi"), "tools": [{"name": "f"}]}}]
        ).id
        for _ in range(3)
    ]
    assert claude.messages.batches.retrieve(made[0]).processing_status == "ended"
    page = claude.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    walked = [b.id for b in claude.messages.batches.list(limit=2)]  # auto-paging by after_id
    assert walked[:3] == made[::-1]
    newer = claude.messages.batches.list(before_id=made[0], limit=5)
    assert [b.id for b in newer.data] == [made[2], made[1]]

    root = stack.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=30) as http:
        headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
        gone = http.get("/v1/messages/batches/msgbatch_nope", headers=headers)
        assert gone.status_code == 404
        assert gone.json()["type"] == "error"
        assert gone.json()["error"]["type"] == "not_found_error"
        assert gone.headers["x-request-id"].startswith("req_")
        no_version = http.get("/v1/messages/batches", headers={"x-api-key": API_KEY})
        assert no_version.status_code == 400
        assert "anthropic-version" in no_version.json()["error"]["message"]
        bad = http.post("/v1/messages/batches", headers=headers, json={"requests": []})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        dup = [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]
        twice = http.post("/v1/messages/batches", headers=headers, json={"requests": dup})
        assert twice.status_code == 400 and "requests.1.custom_id" in twice.text
    wrong_key = anthropic.Anthropic(base_url=root, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong_key.messages.batches.list()
