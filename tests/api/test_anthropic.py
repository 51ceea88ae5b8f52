"""Message batches belong to the tenant whose key created them and count against its quotas,
as OpenAI batches do (no worker runs here: the batches stay in progress)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from testkit.builders.lines import MODEL
from tests.api.conftest import Server

pytestmark = pytest.mark.services

REQUEST = {
    "custom_id": "q1",
    "params": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}


def _claude(server: Server, key: str):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_tenancy_and_the_unfinished_batch_quota(
    start_server: Callable[..., Server], make_key: Callable[..., str]
) -> None:
    import anthropic

    server = start_server(
        BATCHD_MODELS=f'{{"{MODEL}": "demo:llama-tiny"}}',
        BATCHD_MAX_UNFINISHED_BATCHES_PER_TENANT="1",
    )
    mine, theirs = _claude(server, make_key()), _claude(server, make_key())
    batch = mine.messages.batches.create(requests=[REQUEST])
    assert batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 1

    with pytest.raises(anthropic.NotFoundError):
        theirs.messages.batches.retrieve(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        theirs.messages.batches.cancel(batch.id)
    assert theirs.messages.batches.list().data == []
    assert [b.id for b in mine.messages.batches.list().data] == [batch.id]

    with pytest.raises(anthropic.RateLimitError) as caught:  # the tenant's one unfinished batch
        mine.messages.batches.create(requests=[REQUEST])
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert "unfinished batches" in caught.value.body["error"]["message"]
    theirs.messages.batches.create(requests=[REQUEST])  # another tenant's quota is its own
