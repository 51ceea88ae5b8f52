"""The prefix plan at validation and in a shard's run, on real Postgres, local storage and a
real engine host on the tiny model: interleaved few-shot templates come out of validation as
one run order per shard (templates together, longest max_tokens first), the run submits in
that order (its results log, which results-while-running read, follows it, each result with
its custom_id), the output file stays in input order, and a plan that cannot be made leaves
file order."""

from __future__ import annotations

import json
from typing import Any

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

TEMPLATES = 3
LINES = 18


def _template(t: int) -> str:
    examples = " ".join(f"Example {k} of task {t}: the answer is {k * (t + 3)}." for k in range(12))
    return f"You solve task number {t}. {examples}"


def _lines() -> list[dict[str, Any]]:
    out = []
    for i in range(LINES):
        t = i % TEMPLATES  # interleaved in file order
        out.append(
            chat_line(
                f"r{i}",
                "",
                max_tokens=1 + (i * 7) % 5,
                messages=[
                    {"role": "system", "content": _template(t)},
                    {"role": "user", "content": f"question {i}"},
                ],
            )
        )
    return out


def _validated(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    from core.settings import get_settings
    from worker.batches.tasks import validate

    monkeypatch.setenv("BATCHD_SHARD_MAX_REQUESTS", "9")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    batch_id = make_batch(_lines())
    assert validate(batch_id) == "in_progress"
    return batch_id


def _prompt_ids() -> list[list[int]]:
    from core.batchfile.reader import RawLine, parse_request
    from core.llms.generation import prompt_token_ids
    from worker.infra import runtime

    tok = runtime.tokenizer(MODEL)
    out = []
    for n, line in enumerate(_lines(), start=1):
        data = json.dumps(line).encode()
        req = parse_request(
            RawLine(n, 0, len(data), data), endpoint=line["url"], served_models=None
        )
        out.append(prompt_token_ids(tok, req))
    return out


def test_validation_plans_each_shard_along_its_prefix_groups(worker_env, monkeypatch) -> None:
    from core.batches.plan import BLOCK_TOKENS
    from worker.infra.task_io import storage
    from worker.shards.prepared import read_order

    batch_id = _validated(monkeypatch)
    shards = shard_rows(batch_id)
    assert [(s.start_line, s.end_line) for s in shards] == [(1, 10), (10, 19)]
    max_tokens = {n: 1 + ((n - 1) * 7) % 5 for n in range(1, LINES + 1)}
    for shard in shards:
        order = read_order(storage(), batch_id, shard.index)
        lines = list(range(shard.start_line, shard.end_line))
        assert sorted(order) == lines
        templates = [(n - 1) % TEMPLATES for n in order]
        assert templates == sorted(templates)  # each template's lines together, first seen first
        for t in range(TEMPLATES):
            group = [n for n in order if (n - 1) % TEMPLATES == t]
            expect = sorted(group, key=lambda n: (-max_tokens[n], n))
            assert group == expect  # longest expected output first, then file order
    # Predicted: each line's block-aligned prefix an earlier line holds, counted once.
    ids = _prompt_ids()
    shared = 0
    for i, p in enumerate(ids):
        best = 0
        for q in ids[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n // BLOCK_TOKENS)
        shared += best * BLOCK_TOKENS
    row = batch_row(batch_id)
    assert row.prefix_shareable_tokens == shared > 0
    assert shared >= (LINES - TEMPLATES) * 4 * BLOCK_TOKENS  # the templates are long
    # An estimate of the same file (what `batchd submit --dry-run` prints) predicts the same.
    from worker.validation.estimate import scan_file

    scan = scan_file(f"files/{row.input_file_id}", "/v1/chat/completions")
    assert scan["predicted_shareable_tokens"] == shared


def test_the_run_follows_the_plan_and_the_output_keeps_input_order(worker_env, monkeypatch) -> None:
    from core.database.results_log import read_page
    from core.database.sessions import session_scope
    from core.llms.demo import build
    from engine import Engine, EngineHost
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.prepared import read_order
    from worker.shards.task import ShardEnd, run_shard

    monkeypatch.setenv("BATCHD_CHECKPOINT_EVERY", "1")  # a chunk per result: the log's order
    batch_id = _validated(monkeypatch)
    # One request at a time, one waiting: the host runs them in the order they are submitted.
    host = EngineHost(Engine(str(build("llama-tiny")), max_num_seqs=1), group_window=1).start()
    try:
        planned = []
        for shard in shard_rows(batch_id):
            planned += read_order(storage(), batch_id, shard.index)
            assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    finally:
        host.shutdown(wait=True, abort_pending=True, timeout=30)
    with session_scope() as session:
        logged = read_page(session, storage(), batch_id, start=0, limit=100).data
    # Results while running: in plan order, each naming its line's custom_id.
    assert [r["custom_id"] for r in logged] == [f"r{n - 1}" for n in planned]
    assert planned != sorted(planned)
    assert finalize(batch_id) == "completed"
    out = read_file_lines(batch_row(batch_id).output_file_id)
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(LINES)]  # input order
    row = batch_row(batch_id)
    assert row.input_tokens == sum(map(len, _prompt_ids()))
    # One request at a time: every line after its template's first reads the template cached.
    assert row.cached_tokens >= row.prefix_shareable_tokens - TEMPLATES * 16


@pytest.mark.parametrize(
    "env",
    [{"BATCHD_PREFIX_PLAN_MAX_NODES": "0"}, {"BATCHD_PREFIX_PLAN": "false"}],
    ids=["index-capped-at-0-nodes", "plan-off"],
)
def test_without_a_plan_the_shards_keep_file_order(worker_env, monkeypatch, caplog, env) -> None:
    from worker.infra.task_io import storage
    from worker.shards.prepared import order_key, read_order

    caplog.set_level("WARNING", logger="worker.validation.task")
    batch_id = _validated(monkeypatch, **env)
    for shard in shard_rows(batch_id):
        assert read_order(storage(), batch_id, shard.index) == []
        assert not storage().exists(order_key(batch_id, shard.index))
    assert batch_row(batch_id).prefix_shareable_tokens == 0
    if "BATCHD_PREFIX_PLAN_MAX_NODES" in env:
        assert "prefix index full at 0 nodes" in caplog.text


def test_a_malformed_run_order_still_runs_every_line_once(worker_env, monkeypatch, host) -> None:
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.prepared import order_key, read_order
    from worker.shards.task import ShardEnd, run_shard

    batch_id = _validated(monkeypatch)
    first, second = shard_rows(batch_id)
    # Shard 0: an order naming a line of another shard, a line twice and not all of its own,
    # torn in its last id; shard 1: not an order at all.
    with storage().writer(order_key(batch_id, first.index)) as out:
        ids = (5, 15, 5, 2)
        out.write(
            b"BDOR\x01\x00\x00\x00" + b"".join(n.to_bytes(4, "little") for n in ids) + b"\x07"
        )
    with storage().writer(order_key(batch_id, second.index)) as out:
        out.write(b"not an order")
    assert read_order(storage(), batch_id, first.index) == [5, 15, 5, 2]
    assert read_order(storage(), batch_id, second.index) == []  # file order
    for shard in (first, second):
        assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    out = read_file_lines(batch_row(batch_id).output_file_id)
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(LINES)]
    assert batch_row(batch_id).request_completed == LINES
