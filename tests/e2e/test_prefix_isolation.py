"""Prefix-cache isolation through the whole service: one engine serves every tenant, but a
tenant's requests reuse cached prompt blocks only of the same tenant, so ``cached_tokens`` (or
timing) never tells one tenant what another's prompts begin with."""

from __future__ import annotations

import io
import json
import random
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.services, pytest.mark.slow]

MODEL = "batchd-demo"
BLOCK_SIZE = 16  # the engine's default
WORDS = "the batch model token prompt cache block worker queue shard answer question review".split()
# ~450 tokens, the same for every tenant.
PROMPT = " ".join(random.Random(11).choice(WORDS) for _ in range(450))


@pytest.fixture(scope="module")
def tenants(stack) -> dict[str, Any]:
    from openai import OpenAI

    from core.database.auth import create_key
    from core.database.sessions import session_scope

    clients = {}
    for tenant in ("prefix-tenant-a", "prefix-tenant-b"):
        with session_scope(stack.env["BATCHD_DATABASE_URL"]) as session:
            _row, key = create_key(session, tenant, "prefix-isolation")
        clients[tenant] = OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
    return clients


def _run_one(stack, client, custom_id: str) -> dict[str, Any]:
    """One completion request as a batch of one; its response body."""
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
    }
    f = client.files.create(
        file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{batch}\n{stack.log('model')[-3000:]}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, (
        f"{batch}\n{stack.log('model')[-3000:]}"
    )
    (result,) = [
        json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()
    ]
    assert result["custom_id"] == custom_id and result["response"]["status_code"] == 200
    return result["response"]["body"]


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_share_cached_prefixes(stack, tenants) -> None:
    a, b = tenants["prefix-tenant-a"], tenants["prefix-tenant-b"]
    first_a = _run_one(stack, a, "a-1")
    prompt_tokens = first_a["usage"]["prompt_tokens"]
    assert prompt_tokens > 400
    hit = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but a last one
    assert _cached(first_a) == 0
    # Tenant B's first run of the very prompt tenant A just ran: nothing cached for B.
    first_b = _run_one(stack, b, "b-1")
    assert _cached(first_b) == 0
    # Each tenant's second run hits its own cached blocks.
    assert _cached(_run_one(stack, a, "a-2")) == hit
    assert _cached(_run_one(stack, b, "b-2")) == hit
    # Isolation changes no output.
    assert first_b["choices"][0]["text"] == first_a["choices"][0]["text"]
