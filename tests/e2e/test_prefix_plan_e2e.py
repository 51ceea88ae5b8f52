"""The prefix plan through the whole service (API, control worker, model worker on the tiny
model, Postgres, Redis): a file of few-shot blocks interleaved in file order completes with its
output in input order, its results while running name every line, and the batch object and
/ui show the prompt tokens, those the engine served from its prefix cache and the plan's
prediction; an estimate of the same file predicts the same without creating a batch."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from testkit.builders.lines import interleaved_templates, jsonl

pytestmark = [pytest.mark.services, pytest.mark.slow]

TEMPLATES = 3
LINES = 32  # two shards of the stack's 16


def _file() -> bytes:
    return jsonl(interleaved_templates(LINES, TEMPLATES, seed=5, max_tokens_cycle=4))


def _wait(stack, batch_id: str) -> Any:
    deadline = time.monotonic() + 180
    batch = stack.client.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{batch}\n{stack.log('model')[-3000:]}"
        time.sleep(0.2)
        batch = stack.client.batches.retrieve(batch_id)
    return batch


def test_a_planned_batch_completes_in_input_order_and_shows_its_savings(stack, tmp_path) -> None:
    import httpx
    from typer.testing import CliRunner

    from cli.main import app
    from testkit.service.stack import API_KEY

    client = stack.client
    before = {b.id for b in client.batches.list(limit=100).data}  # other tests' batches
    # `batchd submit --dry-run` prints the prediction and creates nothing.
    path = tmp_path / "in.jsonl"
    path.write_bytes(_file())
    dry = CliRunner().invoke(
        app,
        ["submit", str(path), "--dry-run", "--base-url", stack.base_url, "--api-key", API_KEY],
        catch_exceptions=False,
    )
    assert dry.exit_code == 0, dry.output
    assert "shareable prefix" in dry.output
    f = client.files.create(file=("in.jsonl", io.BytesIO(_file())), purpose="batch")
    http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    estimate = http.post(
        "batches/estimate",
        json={
            "input_file_id": f.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert estimate.status_code == 200, estimate.text
    predicted = estimate.json()["predicted_shareable_tokens"]
    assert f"{predicted:,} prompt tokens" in dry.output
    assert predicted > (LINES - TEMPLATES) * 100  # the blocks are long and repeat
    assert {b.id for b in client.batches.list(limit=100).data} == before  # estimates create none

    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _wait(stack, batch.id)
    assert batch.status == "completed", f"{batch}\n{stack.log('control')[-3000:]}"
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == [f"q{i}" for i in range(LINES)]  # input order

    logged = http.get(f"batches/{batch.id}/results", params={"limit": 100}).json()["data"]
    assert sorted(r["custom_id"] for r in logged) == sorted(f"q{i}" for i in range(LINES))

    cache = (batch.model_extra or {})["prefix_cache"]
    assert cache["predicted_shareable_tokens"] == predicted
    assert cache["prompt_tokens"] == batch.usage.input_tokens > 0
    assert cache["cached_tokens"] == batch.usage.input_tokens_details.cached_tokens > 0
    # Each block computed once a shard, at least: the rest of the shareable tokens are served.
    assert cache["cached_tokens"] >= predicted - 2 * TEMPLATES * 200

    root = stack.base_url.removesuffix("/v1")
    ui = httpx.get(f"{root}/ui/data", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    (row,) = [b for b in ui["batches"] if b["id"] == batch.id]
    assert (row["prompt_tokens"], row["cached_tokens"], row["shareable_tokens"]) == (
        cache["prompt_tokens"],
        cache["cached_tokens"],
        predicted,
    )
