"""Batch lifecycle edges at the worker level, on real Postgres, Redis, local storage and an
in-process engine host: a batch with nothing left to run completes even when its finalize
runs past ``expires_at``; an expiring batch with unrun requests still expires; the reclaim
sweep re-sends the validate or finalize of a batch stuck in ``validating``/``finalizing``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from testkit.builders.worker import (
    batch_row,
    chat_line,
    make_batch,
    read_file_lines,
    shard_rows,
    validated_batch,
)

pytestmark = pytest.mark.services


def _update_batch(batch_id: str, **values: Any) -> None:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))


def _past() -> Any:
    from core.database.lifecycle import now

    return now() - timedelta(seconds=1)


def _custom_ids(file_id: str | None) -> list[str]:
    return [r["custom_id"] for r in read_file_lines(file_id)]


def test_finalizing_batch_completes_even_past_its_window(worker_env, host):
    """Every shard is done (the batch is finalizing) but the finalize runs after expires_at,
    as when the control queue is backed up: nothing was cut short, so it completes."""
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    ids = [f"r{i}" for i in range(5)]
    batch_id = validated_batch([chat_line(c, f"say {c}", max_tokens=3) for c in ids])
    (shard,) = shard_rows(batch_id)
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert batch_row(batch_id).status == "finalizing"
    _update_batch(batch_id, expires_at=_past())

    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    assert (batch.status, batch.expired_at, batch.error_file_id) == ("completed", None, None)
    assert batch.request_completed == 5 and _custom_ids(batch.output_file_id) == ids


def test_a_second_finalize_of_a_batch_leaves_it_to_the_first(worker_env, host):
    """A cancel arriving while validation stops, a sweep's re-drive and the last shard each
    finalize: while one runs, another returns at once without merging (each used to merge the
    whole batch, an amplifying upload twice), and the batch still ends once."""
    from worker.batches.finalize import finalize, sole_finalizer
    from worker.shards.task import ShardEnd, run_shard

    ids = [f"r{i}" for i in range(3)]
    batch_id = validated_batch([chat_line(c, f"say {c}", max_tokens=3) for c in ids])
    (shard,) = shard_rows(batch_id)
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    with sole_finalizer(batch_id) as sole:  # as if another control thread were merging it
        assert sole
        with sole_finalizer(batch_id) as second:
            assert not second
        assert finalize(batch_id) is None
        assert (
            batch_row(batch_id).status == "finalizing"
            and batch_row(batch_id).output_file_id is None
        )
    assert finalize(batch_id) == "completed"
    assert _custom_ids(batch_row(batch_id).output_file_id) == ids


def test_expiring_batch_whose_every_request_has_a_result_completes(worker_env, host):
    """The shards stopped for the expiry right after their last result (still in_progress,
    past expires_at): the merge finds no request without a result, so it completes."""
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    ids = [f"r{i}" for i in range(6)]
    batch_id = validated_batch([chat_line(c, f"say {c}", max_tokens=3) for c in ids], 3)
    shards = shard_rows(batch_id)
    assert len(shards) == 2
    for shard in shards:
        assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    # As if each shard had noticed the expiry after committing its last result.
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.batch_id == batch_id).values(status="stopped"))
    _update_batch(batch_id, status="in_progress", finalizing_at=None, expires_at=_past())

    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    assert (batch.status, batch.expired_at, batch.error_file_id) == ("completed", None, None)
    assert batch.finalizing_at is not None and batch.completed_at is not None
    assert batch.request_completed == 6 and _custom_ids(batch.output_file_id) == ids


def test_expiring_batch_with_unrun_requests_still_expires(worker_env, host):
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    ids = [f"r{i}" for i in range(6)]
    batch_id = validated_batch([chat_line(c, f"say {c}", max_tokens=3) for c in ids], 3)
    first, _second = shard_rows(batch_id)
    _update_batch(batch_id, expires_at=_past())
    assert run_shard(first.id, host=host).end == ShardEnd.SKIPPED  # past its window: never runs

    assert finalize(batch_id) == "expired"
    batch = batch_row(batch_id)
    assert batch.status == "expired" and batch.output_file_id is None
    errors = read_file_lines(batch.error_file_id)
    assert [r["custom_id"] for r in errors] == ids
    assert {r["error"]["code"] for r in errors} == {"batch_expired"}


def test_redrive_due_once_per_bound():
    from worker.shards.recovery import redrive_due

    bound, every = 300.0, 10.0
    ages = [t / 2 for t in range(0, 2 * 1000)]  # a sweep every half second for 1,000 s
    due = [age for age in ages if redrive_due(age, bound, 0.5)]
    assert due == [300.0, 600.0, 900.0]
    assert not redrive_due(299.9, bound, every)
    assert redrive_due(305.0, bound, every) and not redrive_due(315.0, bound, every)
    assert redrive_due(1234.0, 5.0, 10.0)  # sweeps less often than the bound: every sweep


def test_reclaim_sweep_resends_stuck_validate_and_finalize(worker_env, monkeypatch):
    """A batch left validating (its validate message lost) or finalizing past
    ``stuck_batch_after_s`` gets its task sent again; a fresh one and an expired one do not.
    (What is sent is recorded here; the e2e tests let a worker run it.)"""
    import worker.shards.recovery
    from core.broker.queue import TASK_FINALIZE, TASK_VALIDATE
    from core.database.lifecycle import now
    from core.settings import get_settings
    from worker.shards.recovery import reclaim_stale_shards

    monkeypatch.setenv("BATCHD_STUCK_BATCH_AFTER_S", "60")
    monkeypatch.setenv("BATCHD_RECLAIM_SWEEP_INTERVAL_S", "10")
    get_settings.cache_clear()
    line = [chat_line("a", "hi")]
    stuck_validating, fresh, expired, stuck_finalizing = (make_batch(line) for _ in range(4))
    long_ago = now() - timedelta(seconds=65)
    _update_batch(stuck_validating, created_at=long_ago)
    _update_batch(expired, created_at=long_ago, expires_at=_past())
    _update_batch(stuck_finalizing, status="finalizing", finalizing_at=long_ago)
    sent: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(
        worker.shards.recovery, "send", lambda task, *args, **_: sent.append((task, args))
    )

    mine = {stuck_validating, fresh, expired, stuck_finalizing}  # the session shares the database

    def swept() -> tuple[list[str], list[str], list[tuple[str, tuple[Any, ...]]]]:
        sent.clear()
        report = reclaim_stale_shards()
        return (
            [b for b in report.revalidated if b in mine],
            [b for b in report.refinalized if b in mine],
            sorted(s for s in sent if s[1][0] in mine),
        )

    assert swept() == (
        [stuck_validating],
        [stuck_finalizing],
        sorted([(TASK_VALIDATE, (stuck_validating,)), (TASK_FINALIZE, (stuck_finalizing,))]),
    )
    # The next sweeps (10 s apart) leave them alone until another bound has passed.
    _update_batch(stuck_validating, created_at=now() - timedelta(seconds=75))
    assert swept()[0] == []
    _update_batch(stuck_validating, created_at=now() - timedelta(seconds=122))
    assert swept()[0] == [stuck_validating]
