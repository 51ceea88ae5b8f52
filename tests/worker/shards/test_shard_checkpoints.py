"""Shard runs on real Postgres, local storage and an in-process engine host: checkpoints,
resume after an interruption, finalize ordering and the last-shard race."""

from __future__ import annotations

import threading

import pytest

from testkit.builders.worker import (
    batch_row,
    chat_line,
    completion_line,
    make_batch,
    read_file_lines,
    shard_rows,
    validated_batch,
)

pytestmark = pytest.mark.services


class Interrupted(Exception):
    pass


def _validated(lines, **kw) -> str:
    from worker.batches.tasks import validate

    batch_id = make_batch(lines, **kw)
    assert validate(batch_id) == "in_progress"
    return batch_id


def test_interrupted_shard_resumes_with_exactly_one_result_per_request(worker_env, host):
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.checkpoints import chunk_key
    from worker.shards.task import ShardEnd, run_shard

    lines = [chat_line(f"r{i}", f"hello number {i}", max_tokens=6) for i in range(22)]
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)
    assert (shard.status, shard.num_requests) == ("pending", 22)

    def stop_after_two(chunk: int) -> None:
        if chunk == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=stop_after_two)
    (shard,) = shard_rows(batch_id)
    # The first chunk is the first result alone (committed as it came), the second a full 4.
    assert (shard.status, shard.num_chunks, shard.done_requests, shard.attempts) == (
        "running",
        2,
        5,
        1,
    )
    assert batch_row(batch_id).request_completed == 5  # live counters advanced per checkpoint
    # A chunk the dead attempt wrote but never committed: the retry must discard it.
    from worker.shards.checkpoints import ChunkRecord, write_chunk

    stray = chunk_key(batch_id, shard.index, 2)
    write_chunk(storage(), stray, [ChunkRecord(1, True, {"custom_id": "r0", "stray": True})])

    outcome = run_shard(shard.id, host=host)
    assert outcome.end == ShardEnd.DONE and outcome.ran == 17
    (shard,) = shard_rows(batch_id)
    assert (shard.status, shard.done_requests, shard.attempts) == ("done", 22, 2)
    batch = batch_row(batch_id)
    assert batch.status == "finalizing"
    assert (batch.request_completed, batch.request_failed) == (22, 0)

    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(22)]
    assert all("stray" not in r for r in out)
    assert batch.error_file_id is None
    assert batch.output_tokens == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in out
    )
    # The committed chunks stay as the batch's results log: the same lines, none of the stray.
    from core.database.results_log import read_page
    from core.database.sessions import session_scope

    with session_scope() as session:
        page = read_page(session, storage(), batch_id, start=0, limit=100)
    assert sorted(r["id"] for r in page.data) == sorted(r["id"] for r in out)
    assert not page.has_more


def test_multi_shard_finalize_keeps_input_order_and_reports_errors(worker_env, host, monkeypatch):
    from core.settings import get_settings
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    monkeypatch.setenv("BATCHD_SHARD_MAX_REQUESTS", "5")
    get_settings.cache_clear()
    lines = []
    for i in range(17):
        if i == 6:
            lines.append(completion_line("long", list(range(3, 1100))))  # over the context
        elif i == 11:
            lines.append(completion_line("bad-token", [5, 7, 99999]))
        else:
            lines.append(completion_line(f"c{i}", f"the cat {i}", max_tokens=4 + i % 5))
    batch_id = _validated(lines, endpoint="/v1/completions")
    shards = shard_rows(batch_id)
    assert [s.num_requests for s in shards] == [5, 5, 5, 2]
    # Shards finish in reverse order, and each writes several chunks whose lines interleave.
    for shard in reversed(shards):
        assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert [r["custom_id"] for r in out] == [f"c{i}" for i in range(17) if i not in (6, 11)]
    assert [r["custom_id"] for r in err] == ["long", "bad-token"]
    assert [r["response"]["status_code"] for r in err] == [400, 400]
    codes = [r["response"]["body"]["error"]["code"] for r in err]
    assert codes == ["context_length_exceeded", "invalid_value"]
    assert (batch.request_completed, batch.request_failed) == (15, 2)


def test_a_line_that_no_longer_parses_gets_an_error_line(worker_env, host):
    """The stored input changed after validation (same length, so the shard's byte range
    still holds its lines): the line that no longer parses is reported, not skipped."""
    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from worker.batches.finalize import finalize
    from worker.infra.task_io import input_key, storage
    from worker.shards.task import ShardEnd, run_shard

    lines = [chat_line(f"r{i}", f"hello number {i}", max_tokens=4) for i in range(6)]
    batch_id = _validated(lines)
    with session_scope() as session:
        key = input_key(session, session.get(Batch, batch_id))
    with storage().reader(key) as stream:
        data = stream.read()
    rows = data.split(b"\n")
    rows[3] = rows[3].replace(b'"messages"', b'"massages"')  # r3: an unknown field, no messages
    rows[4] = rows[4].replace(b'"custom_id": "r4"', b'"custom_id": 4444')  # r4: no custom_id
    changed = b"\n".join(rows)
    assert len(changed) == len(data) and changed != data
    with storage().writer(key) as out:
        out.write(changed)

    (shard,) = shard_rows(batch_id)
    outcome = run_shard(shard.id, host=host)
    assert (outcome.end, outcome.ran) == (ShardEnd.DONE, 6)
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert [r["custom_id"] for r in out] == ["r0", "r1", "r2", "r5"]
    assert [r["custom_id"] for r in err] == ["r3", None]  # r4's custom_id is no string now
    assert [r["response"]["status_code"] for r in err] == [400, 400]
    errors = [r["response"]["body"]["error"] for r in err]
    assert [e["param"] for e in errors] == ["body.massages", "custom_id"]  # the unknown field first
    assert all(e["code"] and "no longer parses" in e["message"] for e in errors)
    assert (batch.request_completed, batch.request_failed) == (4, 2)


def test_last_shard_race_has_one_winner(worker_env):
    import redis

    from worker.shards.task import finish_if_last, set_shard_status

    client = redis.Redis.from_url(worker_env["BATCHD_BROKER_URL"])
    lines = [chat_line(f"r{i}", "hi") for i in range(6)]
    from core.settings import get_settings

    for round_ in range(8):
        get_settings.cache_clear()
        import os

        os.environ["BATCHD_SHARD_MAX_REQUESTS"] = "2"
        try:
            batch_id = _validated(lines)
        finally:
            del os.environ["BATCHD_SHARD_MAX_REQUESTS"]
            get_settings.cache_clear()
        shards = shard_rows(batch_id)
        assert len(shards) == 3
        from worker.shards.task import claim

        attempts = {s.id: claim(s.id, "test")[0] for s in shards}
        client.delete("batchd.control")
        barrier = threading.Barrier(len(shards))
        wins: list[bool] = []

        def finish(shard_id: int, attempt: int, barrier=barrier, wins=wins, batch_id=batch_id):
            barrier.wait()
            assert set_shard_status(shard_id, attempt, "done")
            wins.append(finish_if_last(batch_id))

        threads = [threading.Thread(target=finish, args=(s.id, attempts[s.id])) for s in shards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(wins) == [False, False, True], round_
        assert batch_row(batch_id).status == "finalizing"
        assert client.llen("batchd.control") == 1  # exactly one finalize enqueued


def test_stale_attempt_cannot_commit(worker_env):
    from worker.shards.state import Pending, ShardLost, claim, commit_chunk

    batch_id = _validated([chat_line("a", "hi"), chat_line("b", "yo")])
    (shard,) = shard_rows(batch_id)
    first, _ = claim(shard.id, "w1")
    second, _ = claim(shard.id, "w2", force=True)  # the first attempt is alive: force
    assert second == first + 1
    with pytest.raises(ShardLost):
        commit_chunk(shard, first, 0, Pending())
    commit_chunk(shard, second, 0, Pending())
    assert shard_rows(batch_id)[0].num_chunks == 1


def test_cancel_finalize_keeps_finished_and_reports_the_rest(worker_env, host):
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope
    from worker.batches.finalize import finalize
    from worker.batches.tasks import cancel
    from worker.shards.task import ShardEnd, run_shard

    lines = [chat_line(f"r{i}", f"item {i}", max_tokens=5) for i in range(10)]
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)

    def stop(chunk: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=stop)  # 1 result committed, then dies
    from worker.shards.task import claim

    # Another attempt holds the shard (as a worker killed outright would: fresh heartbeat).
    assert claim(shard.id, "killed-later", force=True) is not None
    with session_scope() as session:
        assert transition(session, batch_id, "in_progress", "cancelling")
    # The shard still looks running (fresh heartbeat): cancel waits for it.
    assert cancel(batch_id) is None
    from sqlalchemy import update

    from core.database.tables import Shard

    with session_scope() as session:  # its heartbeat goes stale
        session.execute(
            update(Shard).values(
                heartbeat_at=Shard.heartbeat_at - __import__("datetime").timedelta(hours=1)
            )
        )
    assert cancel(batch_id) == "cancelled"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert [r["custom_id"] for r in out] + [r["custom_id"] for r in err] == [
        f"r{i}" for i in range(10)
    ] or sorted([r["custom_id"] for r in out + err]) == sorted(f"r{i}" for i in range(10))
    assert len(out) == 1
    assert all(r["error"]["code"] == "batch_cancelled" and r["response"] is None for r in err)
    assert shard_rows(batch_id)[0].status == "closed"
    assert finalize(batch_id) is None  # already terminal: a second finalize does nothing
    # A shard task delivered late exits at once.
    assert run_shard(shard.id, host=host).end == ShardEnd.SKIPPED


def test_a_shard_that_ends_after_the_cancel_finalizes_it(worker_env, host, monkeypatch):
    """The cancel finds the shard running and leaves the finalize to the last shard to end;
    that shard ran to its end (done, not stopped) before it saw the cancel: it must still
    send the finalize, not leave the batch cancelling until the expiry sweep re-drives it."""
    import worker.shards.state
    from core.broker.queue import TASK_FINALIZE
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope
    from worker.batches.tasks import cancel
    from worker.shards.task import ShardEnd, run_shard

    lines = [chat_line(f"r{i}", f"item {i}", max_tokens=3) for i in range(2)]
    batch_id = validated_batch(lines, shard_max_requests=1)
    first, second = shard_rows(batch_id)
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr(worker.shards.state, "send", lambda task, *a, **_: sent.append((task, a)))

    def cancel_now(chunk: int) -> None:  # the shard's only line is committed: it is ending
        with session_scope() as session:
            assert transition(session, batch_id, "in_progress", "cancelling")
        assert cancel(batch_id) is None  # the shard still runs: its end must finalize

    assert run_shard(first.id, host=host, after_commit=cancel_now).end == ShardEnd.DONE
    assert (TASK_FINALIZE, (batch_id,)) in sent
    assert shard_rows(batch_id)[1].status == second.status  # the other never ran


def test_each_committed_result_records_its_finish_to_commit_lag(worker_env, host):
    import time

    from worker.shards import timings
    from worker.shards.task import run_shard

    lines = [chat_line(f"r{i}", f"lag {i}", max_tokens=4) for i in range(10)]
    batch_id = make_batch(lines)
    from worker.batches.tasks import validate

    assert validate(batch_id) == "in_progress"
    before = time.time()
    for shard in shard_rows(batch_id):
        run_shard(shard.id, host=host)
    lags = timings.commit_lags([batch_id])
    assert len(lags) == 10  # one per result the engine finished
    assert all(0.0 <= lag < time.time() - before + 1.0 for lag in lags)
    assert timings.commit_lags(["batch_other"]) == []


def test_a_committed_chunk_lost_from_storage_wedges_nothing(worker_env, host):
    """A committed chunk that vanished from storage: the resumed attempt runs its lines again
    instead of failing for ever, the reclaim sweep is not stopped by it, and the batch
    completes with one line per request; a chunk lost after its shard finished is reported as
    result_lost lines, never dropped."""
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.checkpoints import chunk_key
    from worker.shards.recovery import fail_shard
    from worker.shards.task import ShardEnd, run_shard

    lines = [chat_line(f"r{i}", f"hello number {i}", max_tokens=4) for i in range(10)]
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)

    def stop_after_two(chunk: int) -> None:
        if chunk == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=stop_after_two)
    storage().delete(chunk_key(batch_id, 0, 1))  # the second committed chunk is lost
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(10))

    # Lost once the shard is done: the finalize reports the lines it cannot find.
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    storage().delete(chunk_key(batch_id, 0, 1))
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"r{i}" for i in range(10))
    assert err and {r["error"]["code"] for r in err} == {"result_lost"}

    # Giving up a shard with a lost chunk still reports its lines (the sweep's path).
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)
    with pytest.raises(Interrupted):
        run_shard(shard.id, host=host, after_commit=stop_after_two)
    storage().delete(chunk_key(batch_id, 0, 0))
    assert fail_shard(shard.id, "given up")


def test_deleting_a_result_file_drops_the_batchs_results(worker_env, host):
    """DELETE /v1/files/{id} of a batch's output file: its results log is forgotten (nothing
    served by the results route) and its stored chunks are deleted, even though no other file
    of the batch is left for retention to sweep."""
    from api.services.files import delete_file
    from core.database.results_log import batch_log_prefix, read_page
    from core.database.sessions import session_scope
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.task import run_shard

    lines = [chat_line(f"r{i}", f"hello {i}", max_tokens=3) for i in range(5)]
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)
    run_shard(shard.id, host=host)
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    sto = storage()
    assert sto.list(batch_log_prefix(batch_id))
    with session_scope() as session:
        assert len(read_page(session, sto, batch_id, start=0, limit=100).data) == 5
        delete_file(session, sto, batch.tenant, batch.output_file_id)
    with session_scope() as session:
        assert read_page(session, sto, batch_id, start=0, limit=100).data == []
    assert sto.list(batch_log_prefix(batch_id)) == []
