"""The enqueued-token limit at validation, on real Postgres with the tiny model's tokenizer:
prompt tokens are counted into ``est_prompt_tokens``; a batch that would take its tenant over
the limit on its model fails with ``token_limit_exceeded``; other tenants and finished batches
do not count."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

import pytest

from testkit.builders.worker import batch_row, chat_line, make_batch, shard_rows

pytestmark = pytest.mark.services


def _set(batch_id: str, **values) -> None:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))


_created: list[str] = []


def _batch(tenant: str, lines) -> str:
    batch_id = make_batch(lines)
    _set(batch_id, tenant=tenant)
    _created.append(batch_id)
    return batch_id


@pytest.fixture(autouse=True)
def _end_batches() -> Iterator[None]:
    """End this test's batches afterwards: their shards never run, and the database is shared
    with later tests (whose services would count them as released work of the same model)."""
    yield
    if not _created:
        return
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch, Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.batch_id.in_(_created)).values(status="closed"))
        session.execute(
            update(Batch)
            .where(Batch.id.in_(_created), Batch.status.not_in(("completed", "failed")))
            .values(status="cancelled")
        )
    _created.clear()


def _prompt_tokens(lines) -> int:
    from types import SimpleNamespace

    from core.llms import generation
    from testkit.builders.worker import MODEL
    from worker.infra import runtime

    tok = runtime.tokenizer(MODEL)
    return sum(
        len(
            generation.prompt_token_ids(
                tok,
                SimpleNamespace(
                    kind="chat",
                    model=MODEL,
                    messages=line["body"]["messages"],
                    chat_template_kwargs=None,
                    tools=None,
                    tool_choice=None,
                ),
            )
        )
        for line in lines
    )


@pytest.fixture
def limited(worker_env, monkeypatch):
    from core.settings import get_settings

    lines = [chat_line(f"r{i}", f"tell me about the number {i}") for i in range(5)]
    per_batch = _prompt_tokens(lines)
    # Room for two such batches, not three.
    monkeypatch.setenv("BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT", str(2 * per_batch + per_batch // 2))
    get_settings.cache_clear()
    return lines, per_batch


def test_prompt_tokens_are_counted_and_the_limit_is_enforced(limited):
    from worker.batches.tasks import validate

    lines, per_batch = limited
    tenant = f"t-{secrets.token_hex(3)}"
    first, second, third = (_batch(tenant, lines) for _ in range(3))
    assert validate(first) == "in_progress"
    assert batch_row(first).est_prompt_tokens == per_batch
    assert validate(second) == "in_progress"

    assert validate(third) == "failed"
    row = batch_row(third)
    assert row.status == "failed" and shard_rows(third) == []
    from worker.infra.task_io import storage

    # The prompt ids its head stored before the quota refused it are not kept.
    assert list(storage().list(f"batches/{first}")) and not list(storage().list(f"batches/{third}"))
    (error,) = row.errors
    assert error["code"] == "token_limit_exceeded"
    limit = 2 * per_batch + per_batch // 2
    assert error["message"].startswith(
        f"Enqueued token limit reached for batchd-demo in tenant {tenant}: "
        f"limit {limit:,}, already enqueued {2 * per_batch:,}, this batch {per_batch:,}."
    )
    assert error["line"] is None and error["param"] is None

    # Another tenant has its own room.
    assert validate(_batch(f"{tenant}-other", lines)) == "in_progress"
    # Finished batches stop counting; batches still validating never counted.
    _set(first, status="completed")
    _batch(tenant, lines)  # a batch left in validating
    assert validate(_batch(tenant, lines)) == "in_progress"
    # finalizing and cancelling still count.
    _set(second, status="cancelling")
    assert validate(_batch(tenant, lines)) == "failed"


def test_one_batch_larger_than_the_limit_fails_alone(limited, monkeypatch):
    from core.settings import get_settings
    from worker.batches.tasks import validate

    lines, per_batch = limited
    monkeypatch.setenv("BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT", str(per_batch - 1))
    get_settings.cache_clear()
    batch_id = _batch(f"t-{secrets.token_hex(3)}", lines)
    assert validate(batch_id) == "failed"
    (error,) = batch_row(batch_id).errors
    assert "already enqueued 0, this batch" in error["message"]


def test_concurrent_validations_cannot_both_take_the_last_room(limited, monkeypatch):
    from core.settings import get_settings
    from worker.batches.tasks import validate

    lines, per_batch = limited
    monkeypatch.setenv("BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT", str(per_batch + per_batch // 2))
    get_settings.cache_clear()
    tenant = f"t-{secrets.token_hex(3)}"
    batches = [_batch(tenant, lines) for _ in range(4)]
    results: dict[str, str | None] = {}
    barrier = threading.Barrier(len(batches))

    def run(batch_id: str) -> None:
        barrier.wait()
        results[batch_id] = validate(batch_id)

    threads = [threading.Thread(target=run, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results.values()) == ["failed", "failed", "failed", "in_progress"]
