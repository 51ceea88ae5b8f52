"""Validation streamed into execution, on real Postgres, local storage and an in-process engine
host: shards are created as their lines are validated; a bad line after the head becomes an
error line; a whole-file rule broken late fails the batch with nothing of it shown; a cancel
during validation and a validation that dies half-way still end with exactly one output or
error line per input line (``worker.validation.task``)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest

from testkit.builders.worker import (
    MODEL,
    batch_row,
    chat_line,
    make_batch,
    read_file_lines,
    shard_rows,
)

pytestmark = pytest.mark.services

SHARD = 4  # requests per shard: a short file has several


class Killed(BaseException):
    """The validating process died (no handler runs: a BaseException, as SIGKILL is)."""


@pytest.fixture
def small_shards(worker_env, monkeypatch) -> None:
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_SHARD_MAX_REQUESTS", str(SHARD))
    get_settings.cache_clear()


@pytest.fixture
def after_shard(monkeypatch) -> Iterator[list[Callable[[int], None]]]:
    """Callbacks run after each shard the validation creates (with its index)."""
    from worker.validation.task import StreamedValidation

    hooks: list[Callable[[int], None]] = []
    real = StreamedValidation._create

    def create(self, spec, *, last):
        outcome = real(self, spec, last=last)
        if outcome is None:
            for hook in hooks:
                hook(spec.index)
        return outcome

    monkeypatch.setattr(StreamedValidation, "_create", create)
    yield hooks


_created: list[str] = []


def _make(lines: list, tenant: str | None = None) -> str:
    batch_id = make_batch(lines)
    _created.append(batch_id)
    if tenant is not None:
        _update(batch_id, tenant=tenant)
    return batch_id


def _update(batch_id: str, **values) -> None:
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))


def _end(batch_ids: list[str]) -> None:
    """End batches whose shards will never run: the database is shared with later tests,
    whose releases would count their released shards as work of the same model."""
    from sqlalchemy import update

    from core.database.sessions import session_scope
    from core.database.tables import Batch, Shard

    with session_scope() as session:
        session.execute(update(Shard).where(Shard.batch_id.in_(batch_ids)).values(status="closed"))
        session.execute(
            update(Batch)
            .where(Batch.id.in_(batch_ids), Batch.status.not_in(("completed", "failed")))
            .values(status="cancelled")
        )


@pytest.fixture(autouse=True)
def _end_batches() -> Iterator[None]:
    yield
    if _created:
        _end(_created)
        _created.clear()


def _lines(n: int, start: int = 0) -> list[dict]:
    return [chat_line(f"r{i}", f"say the number {i}", max_tokens=3) for i in range(start, n)]


def _run_all(batch_id: str, host) -> None:
    from worker.shards.task import run_shard

    for shard in shard_rows(batch_id):
        if shard.status == "pending":
            run_shard(shard.id, host=host)


def _one_line_each(batch, custom_ids: list[str | None]) -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines, checked to hold exactly one line per input line."""
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    got = sorted((r["custom_id"] or "") for r in out + err)
    assert got == sorted((c or "") for c in custom_ids)
    return out, err


def _contiguous(batch_id: str) -> list:
    shards = shard_rows(batch_id)
    assert [s.index for s in shards] == list(range(len(shards)))
    for a, b in zip(shards, shards[1:], strict=False):
        assert (a.end_line, a.end_offset) == (b.start_line, b.start_offset)
    return shards


def _log_lines(batch_id: str) -> int:
    from sqlalchemy import func, select

    from core.database.sessions import session_scope
    from core.database.tables import ResultLine

    with session_scope() as session:
        return session.scalar(
            select(func.count()).select_from(ResultLine).where(ResultLine.batch_id == batch_id)
        )


def test_bad_lines_after_the_head_become_error_lines(small_shards, host):
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate

    lines: list = _lines(16)
    lines[6] = '{"custom_id": "broken", "method": "POST"'  # line 7: not JSON
    lines[9] = chat_line("r1", "a second r1")  # line 10: duplicate custom_id
    lines[12] = chat_line("r12", "hi", model="nope")  # line 13: not served
    lines += ["[1, 2]", "{}", "{}"]  # lines 17-19: a shard of bad lines only
    batch_id = _make(lines)

    assert validate(batch_id) == "in_progress"
    batch = batch_row(batch_id)
    assert batch.validation_done and batch.request_total == len(lines)
    assert batch.request_failed == 6  # the bad lines' error lines are committed already
    shards = _contiguous(batch_id)
    assert [s.num_requests for s in shards] == [4, 4, 4, 4, 3]
    assert [s.done_requests for s in shards] == [0, 1, 1, 1, 3]
    assert shards[-1].status == "done"  # nothing in it to run

    _run_all(batch_id, host)
    assert finalize(batch_id) == "completed"
    batch = batch_row(batch_id)
    custom_ids = [x["custom_id"] if isinstance(x, dict) else None for x in lines]
    out, err = _one_line_each(batch, custom_ids)
    assert len(out) == 13 and (batch.request_completed, batch.request_failed) == (13, 6)
    errors = {r["response"]["body"]["error"]["line"]: r for r in err}
    assert sorted(errors) == [7, 10, 13, 17, 18, 19]
    codes = {line: r["response"]["body"]["error"]["code"] for line, r in errors.items()}
    assert codes == {
        7: "invalid_json_line",
        10: "duplicate_custom_id",
        13: "model_not_found",
        17: "invalid_json_line",
        18: "missing_custom_id",
        19: "missing_custom_id",
    }
    assert all(r["response"]["status_code"] == 400 for r in err)
    assert all(f"line {line}" in r["response"]["body"]["error"]["message"].lower()
               for line, r in errors.items())  # fmt: skip
    # The error line names the custom_id when the line can be read as an object.
    assert errors[10]["custom_id"] == "r1" and errors[13]["custom_id"] == "r12"
    assert errors[7]["custom_id"] is None and errors[18]["custom_id"] is None
    assert _log_lines(batch_id) == len(lines)  # the results log holds them too


def test_an_error_in_the_head_fails_the_batch_as_before(small_shards):
    from worker.batches.tasks import validate

    lines: list = _lines(12)
    lines[2] = "not json"  # in the head (the first shard's lines)
    lines[8] = chat_line("r8", "hi", model="nope")  # after it: still reported
    batch_id = _make(lines)

    assert validate(batch_id) == "failed"
    batch = batch_row(batch_id)
    assert [(e["code"], e["line"]) for e in batch.errors] == [
        ("invalid_json_line", 3),
        ("model_not_found", 9),
    ]
    assert shard_rows(batch_id) == [] and batch.output_file_id is batch.error_file_id is None


def test_a_bad_line_right_after_a_full_head_is_not_in_the_head(small_shards):
    from worker.batches.tasks import validate

    lines: list = _lines(SHARD + 2)
    lines[SHARD] = "not json"  # the line after the head's SHARD requests
    batch_id = _make(lines)
    assert validate(batch_id) == "in_progress"
    assert [(s.start_line, s.end_line, s.done_requests) for s in shard_rows(batch_id)] == [
        (1, SHARD + 1, 0),
        (SHARD + 1, SHARD + 3, 1),
    ]


def test_a_head_error_counts_every_line_as_before(small_shards):
    from worker.batches.tasks import validate

    lines: list = _lines(3) + ["{}"]
    batch_id = _make(lines)
    assert validate(batch_id) == "failed"
    assert batch_row(batch_id).request_total == 4


def _failed_late(batch_id: str) -> dict:
    from api.services.results import results_visible
    from core.database.results_log import batch_log_prefix
    from worker.infra.task_io import storage

    batch = batch_row(batch_id)
    assert batch.status == "failed"
    assert batch.output_file_id is None and batch.error_file_id is None
    assert not results_visible(batch.status, batch.validation_done)
    assert _log_lines(batch_id) == 0 and storage().list(batch_log_prefix(batch_id)) == []
    assert {s.status for s in shard_rows(batch_id)} <= {"done", "closed"}
    (error,) = batch.errors
    return error


def test_too_many_requests_found_late_fails_the_batch_showing_nothing(
    small_shards, host, after_shard, monkeypatch
):
    from core.settings import get_settings
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard

    monkeypatch.setenv("BATCHD_MAX_REQUESTS_PER_BATCH", "10")
    get_settings.cache_clear()
    batch_id = _make(_lines(14))
    ran: list[int] = []

    def run_first(index: int) -> None:
        if index == 0:  # the head runs before the rest is validated
            run_shard(shard_rows(batch_id)[0].id, host=host)
            ran.append(_log_lines(batch_id))

    after_shard.append(run_first)
    assert validate(batch_id) == "failed"
    assert ran == [SHARD]  # results were committed, and are gone
    error = _failed_late(batch_id)
    assert (error["code"], error["line"]) == ("too_many_requests", 11)
    assert "10" in error["message"] and "line 11" in error["message"]


def test_enqueued_token_limit_crossed_late_fails_the_batch_naming_the_line(
    small_shards, monkeypatch
):
    from core.settings import get_settings
    from worker.batches.tasks import validate

    tenant = f"t-{secrets.token_hex(3)}"
    probe = _make(_lines(12), tenant)
    assert validate(probe) == "in_progress"
    # Each request may write 3 tokens: the rest of a shard's estimate is its prompt tokens.
    prompts = [s.est_tokens - 3 * s.num_requests for s in shard_rows(probe)]
    _end([probe])
    limit = prompts[0] + prompts[1] + 1  # the third shard's first line crosses it
    monkeypatch.setenv("BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT", str(limit))
    get_settings.cache_clear()
    batch_id = _make(_lines(12), tenant)

    assert validate(batch_id) == "failed"
    error = _failed_late(batch_id)
    assert (error["code"], error["line"]) == ("token_limit_exceeded", 9)
    assert f"limit {limit:,}, already enqueued 0" in error["message"]
    assert "through line 9" in error["message"]


def _cancel(batch_id: str) -> None:
    """What ``POST /v1/batches/{id}/cancel`` does to the row."""
    from core.database.lifecycle import CANCELLABLE, BatchStatus, transition
    from core.database.sessions import session_scope

    with session_scope() as session:
        assert transition(session, batch_id, CANCELLABLE, BatchStatus.CANCELLING)


def test_cancel_during_validation_reports_every_line(small_shards, host, after_shard):
    from worker.batches.tasks import cancel, validate
    from worker.shards.task import run_shard

    lines = _lines(18)
    batch_id = _make(lines)

    def cancel_after_second(index: int) -> None:
        if index == 0:
            run_shard(shard_rows(batch_id)[0].id, host=host)
        if index == 1:
            _cancel(batch_id)

    after_shard.append(cancel_after_second)
    assert validate(batch_id) == "cancelled"  # the validation stopped and finalized it
    assert cancel(batch_id) is None  # the cancel task finds it over
    batch = batch_row(batch_id)
    assert len(shard_rows(batch_id)) == 2 and not batch.validation_done
    out, err = _one_line_each(batch, [x["custom_id"] for x in lines])
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(SHARD)]
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert (batch.request_total, batch.request_completed) == (18, SHARD)
    assert _log_lines(batch_id) == len(lines)


def test_cancel_before_the_first_shard_reports_every_line(small_shards):
    from worker.batches.tasks import cancel

    lines = _lines(6)
    batch_id = _make(lines)
    _cancel(batch_id)
    assert cancel(batch_id) == "cancelled"
    out, err = _one_line_each(batch_row(batch_id), [x["custom_id"] for x in lines])
    assert out == [] and {r["error"]["code"] for r in err} == {"batch_cancelled"}


def test_a_validation_that_dies_resumes_after_its_last_shard(small_shards, host, after_shard):
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate

    lines: list = _lines(22)
    lines[5] = chat_line("r1", "again")  # line 6: a duplicate of a line before the crash
    lines[17] = chat_line("r3", "again")  # line 18: one after it
    whole = _make(lines)
    assert validate(whole) == "in_progress"
    expected = batch_row(whole)
    _end([whole])

    batch_id = _make(lines)

    def die(index: int) -> None:
        if index == 2:
            raise Killed

    after_shard.append(die)
    with pytest.raises(Killed):
        validate(batch_id)
    after_shard.clear()
    batch = batch_row(batch_id)
    assert (batch.status, batch.validation_done, len(shard_rows(batch_id))) == (
        "in_progress",
        False,
        3,
    )
    # Its shards so far all finish: the batch waits for the rest of its plan.
    _run_all(batch_id, host)
    assert batch_row(batch_id).status == "in_progress"

    assert validate(batch_id) == "in_progress"  # the redelivered task
    assert validate(batch_id) is None  # and a duplicate finds it done
    batch = batch_row(batch_id)
    assert batch.validation_done and batch.request_total == len(lines)
    assert batch.est_prompt_tokens == expected.est_prompt_tokens  # counted once
    shards = _contiguous(batch_id)
    assert [(s.start_line, s.end_line) for s in shards] == [
        (s.start_line, s.end_line) for s in shard_rows(whole)
    ]
    _run_all(batch_id, host)
    assert batch_row(batch_id).status == "finalizing"
    assert finalize(batch_id) == "completed"
    out, err = _one_line_each(batch_row(batch_id), [x["custom_id"] for x in lines])
    assert sorted(r["response"]["body"]["error"]["line"] for r in err) == [6, 18]
    assert {r["response"]["body"]["error"]["code"] for r in err} == {"duplicate_custom_id"}
    assert batch_row(batch_id).model == MODEL


def test_expiry_during_validation_reports_every_line(small_shards, host, after_shard):
    from datetime import timedelta

    from core.database.lifecycle import now
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard

    lines = _lines(14)
    batch_id = _make(lines)

    def expire_after_second(index: int) -> None:
        if index == 0:
            run_shard(shard_rows(batch_id)[0].id, host=host)
        if index == 1:
            _update(batch_id, expires_at=now() - timedelta(seconds=1))

    after_shard.append(expire_after_second)
    assert validate(batch_id) == "expired"  # the validation stopped and finalized it
    batch = batch_row(batch_id)
    assert len(shard_rows(batch_id)) == 2 and not batch.validation_done
    out, err = _one_line_each(batch, [x["custom_id"] for x in lines])
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(SHARD)]
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert batch.request_total == len(lines)


NESTED = '{"custom_id": "deep", "body": ' + "[" * 5000 + "]" * 5000 + "}"  # past json's recursion


def test_a_deeply_nested_line_does_not_wedge_a_cancel(small_shards):
    """A line nested too deeply for the parser, cancelled before validation reached it: the
    finalize reads it as validation would (a line with no custom_id) and the batch ends
    cancelled, every line reported once."""
    from worker.batches.tasks import cancel

    lines = [*_lines(3), NESTED, *_lines(6, start=3)]
    batch_id = _make(lines)
    _cancel(batch_id)
    assert cancel(batch_id) == "cancelled"
    batch = batch_row(batch_id)
    assert batch.status == "cancelled"
    ids = [x["custom_id"] if isinstance(x, dict) else None for x in lines]
    _, err = _one_line_each(batch, ids)
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}


def test_cancel_before_validation_reports_at_most_the_request_limit(small_shards, monkeypatch):
    """An upload of junk lines cancelled before validation: at most max_requests_per_batch
    batch_cancelled lines, then one line naming the limit; the rest of the file is not read."""
    from core.settings import get_settings
    from worker.batches.tasks import cancel

    monkeypatch.setenv("BATCHD_MAX_REQUESTS_PER_BATCH", "20")
    get_settings.cache_clear()
    lines = [*_lines(5), *(["a"] * 2000)]
    batch_id = _make(lines)
    _cancel(batch_id)
    assert cancel(batch_id) == "cancelled"
    batch = batch_row(batch_id)
    err = read_file_lines(batch.error_file_id)
    assert len(err) == 21 and batch.request_total == 21
    assert [r["custom_id"] for r in err[:5]] == [f"r{i}" for i in range(5)]
    assert "max_requests_per_batch" in err[-1]["error"]["message"]
    assert "Line 21 and the lines after it" in err[-1]["error"]["message"]
