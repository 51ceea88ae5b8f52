"""Tools through the whole service: a batch of chat lines with ``tools`` and a forced
``tool_choice`` uploaded with the ``openai`` client, run by the real Celery workers on the demo
model, comes back as ``tool_calls`` whose arguments validate against their functions'
schemas; a Message Batch with ``tool_choice: any`` comes back as ``tool_use`` blocks."""

from __future__ import annotations

import io
import json
import time

import jsonschema
import pytest

from testkit.builders.lines import MODEL, chat_line, jsonl
from testkit.service.stack import API_KEY
from tests.worker.test_tools_batch import SCHEMAS, TOOLS

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_forced_tool_calls_through_the_service(stack) -> None:
    lines = [
        chat_line(f"r{i}", f"request {i}", 96, tools=TOOLS, tool_choice="required", seed=i)
        for i in range(4)
    ] + [
        chat_line(
            "named",
            "add please",
            96,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
    ]
    client = stack.client
    f = client.files.create(file=("tools.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
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
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    for o in out:
        choice = o["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        assert o["custom_id"] != "named" or name == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])

    import anthropic

    claude = anthropic.Anthropic(
        base_url=stack.base_url.removesuffix("/v1"), api_key=API_KEY, max_retries=0
    )
    params = {
        "model": MODEL,
        "max_tokens": 96,
        "temperature": 0,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()],
        "tool_choice": {"type": "any"},
    }
    created = claude.messages.batches.create(requests=[{"custom_id": "a", "params": params}])
    deadline = time.monotonic() + 180
    while claude.messages.batches.retrieve(created.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    (result,) = list(claude.messages.batches.results(created.id))
    assert result.result.type == "succeeded", result
    message = result.result.message
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, SCHEMAS[block.name])
