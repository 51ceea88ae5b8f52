"""Shards along groups: with the prefix plan, validation cuts a file of interleaved few-shot
templates into shards that each hold lines of one template (or whole small ones), drawn from a
window of the file's range; every line lands in exactly one shard and runs exactly once through
an interrupted attempt, a cancel reports each unfinished line once, the output stays in input
order, a lost line list is rebuilt from the others' (never guessed), and with the plan off the
shards are contiguous as before. Real Postgres, local storage and a real engine host on the tiny model."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.builders.worker import batch_row, chat_line, make_batch, read_file_lines, shard_rows

pytestmark = pytest.mark.services

TEMPLATES = 3
LINES = 45
BAD = 20  # a line that fails validation after the first shard (1-based)
PER_SHARD = 6


class Interrupted(Exception):
    pass


def _template(t: int) -> str:
    examples = " ".join(f"Example {k} of task {t}: the answer is {k * (t + 3)}." for k in range(12))
    return f"You solve task number {t}. {examples}"


def _template_of(line: int) -> int:
    return (line - 1) % TEMPLATES


def _lines() -> list[dict[str, Any]]:
    out = []
    for n in range(1, LINES + 1):
        messages: Any = [
            {"role": "system", "content": _template(_template_of(n))},
            {"role": "user", "content": f"question {n}"},
        ]
        if n == BAD:
            messages = "not a list of messages"
        out.append(chat_line(f"r{n}", "", max_tokens=1 + n % 4, messages=messages))
    return out


def _validated(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    from core.settings import get_settings
    from worker.batches.tasks import validate

    monkeypatch.setenv("BATCHD_SHARD_MAX_REQUESTS", str(PER_SHARD))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    batch_id = make_batch(_lines())
    assert validate(batch_id) == "in_progress"
    return batch_id


def _own(batch_id: str, shard: Any) -> list[int]:
    from worker.infra.task_io import storage
    from worker.shards.checkpoints import own_lines

    key = f"files/{batch_row(batch_id).input_file_id}"
    lines = own_lines(storage(), batch_id, shard, key)
    return list(range(shard.start_line, shard.end_line)) if lines is None else lines


def _assert_along_groups(batch_id: str) -> list[Any]:
    shards = shard_rows(batch_id)
    owned = {s.index: _own(batch_id, s) for s in shards}
    # Every line in exactly one shard; each shard's count is its own lines'.
    every = sorted(n for lines in owned.values() for n in lines)
    assert every == list(range(1, LINES + 1))
    assert all(s.num_requests == len(owned[s.index]) for s in shards)
    assert batch_row(batch_id).request_total == LINES
    head, rest = shards[0], shards[1:]
    assert (head.start_line, head.end_line) == (1, PER_SHARD + 1)  # the first starts at once
    windows: dict[int, list[int]] = {}
    for s in rest:
        windows.setdefault(s.start_offset, []).extend(owned[s.index])
    assert len(windows) < len(rest)  # shards share their window's range
    for s in rest:
        lines = [n for n in owned[s.index] if n != BAD]
        groups = {_template_of(n) for n in lines}
        window = windows[s.start_offset]
        whole = all(
            {n for n in window if _template_of(n) == t and n != BAD} <= set(lines) for t in groups
        )
        assert len(groups) == 1 or whole, (s.index, lines)
        assert s.end_line - s.start_line > len(owned[s.index])  # drawn from a wider range
    return shards


def test_shards_along_groups_run_each_line_once_in_input_order(
    worker_env, monkeypatch, host
) -> None:
    from core.database.results_log import read_page
    from core.database.sessions import session_scope
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.task import ShardEnd, run_shard

    monkeypatch.setenv("BATCHD_CHECKPOINT_EVERY", "2")
    batch_id = _validated(monkeypatch)
    shards = _assert_along_groups(batch_id)

    def die(chunk: int) -> None:
        raise Interrupted

    # A windowed shard's attempt dies after its first result; the next one resumes it.
    victim = next(s for s in shards[1:] if s.num_requests > 2 and BAD not in _own(batch_id, s))
    with pytest.raises(Interrupted):
        run_shard(victim.id, host=host, after_commit=die)
    for shard in reversed(shards):  # any order: each runs its own lines
        bad_only = _own(batch_id, shard) == [BAD]  # done at creation: its error line
        end = ShardEnd.SKIPPED if bad_only else ShardEnd.DONE
        assert run_shard(shard.id, host=host).end == end
    for shard in shard_rows(batch_id):
        assert (shard.status, shard.done_requests) == ("done", shard.num_requests)
    with session_scope() as session:
        logged = read_page(session, storage(), batch_id, start=0, limit=1000).data
    assert sorted(r["custom_id"] for r in logged) == sorted(f"r{n}" for n in range(1, LINES + 1))
    assert finalize(batch_id) == "completed"
    row = batch_row(batch_id)
    out = read_file_lines(row.output_file_id)
    err = read_file_lines(row.error_file_id)
    assert [r["custom_id"] for r in out] == [f"r{n}" for n in range(1, LINES + 1) if n != BAD]
    assert [r["custom_id"] for r in err] == [f"r{BAD}"]
    assert (row.request_completed, row.request_failed) == (LINES - 1, 1)


def test_a_cancel_reports_each_unfinished_line_of_a_window_once(
    worker_env, monkeypatch, host
) -> None:
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope
    from worker.batches.tasks import cancel
    from worker.shards.task import ShardEnd, run_shard

    batch_id = _validated(monkeypatch)
    shards = _assert_along_groups(batch_id)
    ran = shards[2]
    assert run_shard(ran.id, host=host).end == ShardEnd.DONE
    with session_scope() as session:
        assert transition(session, batch_id, "in_progress", "cancelling")
    assert cancel(batch_id) == "cancelled"
    row = batch_row(batch_id)
    out = read_file_lines(row.output_file_id)
    err = read_file_lines(row.error_file_id)
    assert sorted(int(r["custom_id"][1:]) for r in out) == sorted(
        n for n in _own(batch_id, ran) if n != BAD
    )
    merged = sorted(out + err, key=lambda r: int(r["custom_id"][1:]))
    assert [r["custom_id"] for r in merged] == [f"r{n}" for n in range(1, LINES + 1)]
    assert [int(r["custom_id"][1:]) for r in err] == sorted(int(r["custom_id"][1:]) for r in err)
    assert all(r["error"]["code"] == "batch_cancelled" for r in err if r["custom_id"] != f"r{BAD}")


def test_a_lost_line_list_is_rebuilt_from_the_others_or_never_guessed(
    worker_env, monkeypatch
) -> None:
    from worker.infra.task_io import storage
    from worker.shards.checkpoints import lines_without_result, own_lines
    from worker.shards.prepared import ShardLinesLost, lines_key

    batch_id = _validated(monkeypatch)
    shards = _assert_along_groups(batch_id)
    key = f"files/{batch_row(batch_id).input_file_id}"
    lost, other = shards[1], next(s for s in shards[2:] if s.start_offset == shards[1].start_offset)
    before = _own(batch_id, lost)
    storage().delete(lines_key(batch_id, lost.index))
    # The lines of its range the other shards of the range do not name: its own, in file order.
    assert own_lines(storage(), batch_id, lost, key) == sorted(before)
    unfinished = [line for line, _ in lines_without_result(storage(), key, batch_id, lost, 0)]
    assert unfinished == sorted(before)
    storage().delete(lines_key(batch_id, other.index))  # two lost: never guessed
    with pytest.raises(ShardLinesLost):
        own_lines(storage(), batch_id, lost, key)
    with pytest.raises(ShardLinesLost):
        list(lines_without_result(storage(), key, batch_id, other, 0))


@pytest.mark.parametrize("env", [{"BATCHD_PREFIX_PLAN": "false"}], ids=["plan-off"])
def test_without_the_plan_the_shards_are_contiguous(worker_env, monkeypatch, env) -> None:
    from worker.infra.task_io import storage
    from worker.shards.prepared import lines_key

    batch_id = _validated(monkeypatch, **env)
    shards = shard_rows(batch_id)
    assert shards[0].start_line == 1 and shards[-1].end_line == LINES + 1
    for before, after in zip(shards, shards[1:], strict=False):
        assert (before.end_line, before.end_offset) == (after.start_line, after.start_offset)
    assert all(s.num_requests == s.end_line - s.start_line for s in shards)
    assert not any(storage().exists(lines_key(batch_id, s.index)) for s in shards)
