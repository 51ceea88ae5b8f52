"""The shard salts each request's prefix cache with its batch's tenant, unless the operator
shares one cache across tenants (BATCHD_SHARE_PREFIX_CACHE_ACROSS_TENANTS, for single-tenant
deployments). Real Postgres, local storage and an in-process engine host."""

from __future__ import annotations

import pytest

from testkit.builders.worker import (
    batch_row,
    completion_line,
    make_batch,
    read_file_lines,
    shard_rows,
)

pytestmark = pytest.mark.services

BLOCK_SIZE = 16  # the engine's default


def _cached_tokens(tenant: str, prompt: list[int], host) -> int:
    """Run ``prompt`` as ``tenant``'s batch of one through validate, the shard and finalize."""
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate
    from worker.shards.task import ShardEnd, run_shard

    batch_id = make_batch([completion_line("c", prompt, max_tokens=2)], endpoint="/v1/completions")
    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(tenant=tenant))
    assert validate(batch_id) == "in_progress"
    (shard,) = shard_rows(batch_id)
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    (line,) = read_file_lines(batch_row(batch_id).output_file_id)
    return line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("share", [False, True], ids=["per-tenant", "shared"])
def test_operator_setting_shares_the_prefix_cache_across_tenants(
    worker_env, host, monkeypatch, share: bool
) -> None:
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_SHARE_PREFIX_CACHE_ACROSS_TENANTS", str(share).lower())
    get_settings.cache_clear()
    # A prompt of its own per case: the host (and its cache) lives for the whole session.
    prompt = [3 + (7 * i + 101 * share) % 2000 for i in range(100)]
    hit = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert _cached_tokens("tenant-a", prompt, host) == 0
    assert _cached_tokens("tenant-b", prompt, host) == (hit if share else 0)
    assert _cached_tokens("tenant-a", prompt, host) == hit
