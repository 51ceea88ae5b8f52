"""Shards along groups through the whole service (API, control worker, model worker on the tiny
model, Postgres, Redis): a file of few-shot blocks interleaved in file order is validated into
shards that each hold lines of one block, drawn from a window of the file; the batch completes
with every line once, its output in input order and its results while running naming each
line once."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from testkit.builders.lines import interleaved_templates, jsonl

pytestmark = [pytest.mark.services, pytest.mark.slow]

TEMPLATES = 3
LINES = 80  # the stack's shards are 16 lines: a first shard, then windows


def _file() -> bytes:
    return jsonl(interleaved_templates(LINES, TEMPLATES, seed=7, max_tokens_cycle=3))


def _wait(stack, batch_id: str) -> Any:
    deadline = time.monotonic() + 240
    batch = stack.client.batches.retrieve(batch_id)
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{batch}\n{stack.log('model')[-3000:]}"
        time.sleep(0.2)
        batch = stack.client.batches.retrieve(batch_id)
    return batch


def test_shards_along_groups_complete_each_line_once_in_input_order(stack) -> None:
    import httpx
    from sqlalchemy import create_engine, text

    from testkit.service.stack import API_KEY

    client = stack.client
    f = client.files.create(file=("in.jsonl", io.BytesIO(_file())), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _wait(stack, batch.id)
    assert batch.status == "completed", f"{batch}\n{stack.log('control')[-3000:]}"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == [f"q{i}" for i in range(LINES)]  # input order
    http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    logged = http.get(f"batches/{batch.id}/results", params={"limit": 200}).json()["data"]
    assert sorted(r["custom_id"] for r in logged) == sorted(f"q{i}" for i in range(LINES))

    engine = create_engine(stack.env["BATCHD_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            shards = conn.execute(
                text(
                    "SELECT index, start_offset, num_requests, done_requests FROM shards "
                    "WHERE batch_id = :id ORDER BY index"
                ),
                {"id": batch.id},
            ).all()
    finally:
        engine.dispose()
    assert sum(s.num_requests for s in shards) == LINES
    assert all(s.done_requests == s.num_requests for s in shards)
    assert len({s.start_offset for s in shards}) < len(shards)  # shards share a window
