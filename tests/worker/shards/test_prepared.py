"""The prompt ids validation stores beside each shard (worker.shards.prepared), on real Postgres,
local storage and an in-process engine host: stored for every generation request, used by
the shard's run instead of tokenizing again, and not needed (a shard without them tokenizes)."""

from __future__ import annotations

import pytest

from testkit.builders.worker import (
    batch_row,
    chat_line,
    make_batch,
    read_file_lines,
    shard_rows,
)

pytestmark = pytest.mark.services


def _validated(lines) -> str:
    from worker.batches.tasks import validate

    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress"
    return batch_id


def test_round_trip_and_a_torn_object(worker_env) -> None:
    from worker.infra.task_io import storage
    from worker.shards.prepared import _MAGIC, prepared_key, read_prepared, write_prepared

    mark = bytes(range(16))
    items = [(3, [1, 2, 3]), (4, []), (9, [2**32 - 1, 0, 7])]
    write_prepared(storage(), "batch_x", 2, items, mark)
    assert read_prepared(storage(), "batch_x", 2, mark) == dict(items)
    assert read_prepared(storage(), "batch_x", 3, mark) == {}  # none stored
    with storage().writer(prepared_key("batch_x", 4)) as out:  # cut inside the last record
        data = b"".join(n.to_bytes(4, "little") for n in (3, 2, 5, 6, 9, 4, 1))
        out.write(_MAGIC + mark + data)
    assert read_prepared(storage(), "batch_x", 4, mark) == {3: [5, 6]}


def test_ids_made_by_another_tokenizer_are_not_used(worker_env) -> None:
    import copy

    from testkit.builders.worker import MODEL
    from worker.infra import runtime
    from worker.infra.task_io import storage
    from worker.shards.prepared import (
        prepared_key,
        read_prepared,
        tokenizer_fingerprint,
        write_prepared,
    )

    tok = runtime.tokenizer(MODEL)
    mark = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(copy.deepcopy(tok)) == mark  # the same tokenizer loaded twice
    changed = copy.deepcopy(tok)
    changed.chat_template = (changed.chat_template or "") + "{{ '!' }}"
    added = copy.deepcopy(tok)
    added.add_tokens(["<batchd-new-token>"])
    assert len({mark, tokenizer_fingerprint(changed), tokenizer_fingerprint(added)}) == 3

    write_prepared(storage(), "batch_y", 0, [(1, [5, 6, 7])], mark)
    assert read_prepared(storage(), "batch_y", 0, mark) == {1: [5, 6, 7]}
    # A shard whose tokenizer is another (the model directory replaced since validation)
    # tokenizes its lines itself.
    assert read_prepared(storage(), "batch_y", 0, tokenizer_fingerprint(changed)) == {}
    with storage().writer(prepared_key("batch_y", 1)) as out:  # the format before the header
        out.write(b"".join(n.to_bytes(4, "little") for n in (1, 2, 5, 6)))
    assert read_prepared(storage(), "batch_y", 1, mark) == {}


def test_validation_stores_the_ids_the_shard_would_compute(worker_env, monkeypatch) -> None:
    from core.batchfile.reader import RawLine, parse_request
    from core.llms.generation import prompt_token_ids
    from worker.infra import runtime
    from worker.infra.task_io import storage
    from worker.shards.prepared import read_prepared, tokenizer_fingerprint

    monkeypatch.setenv("BATCHD_SHARD_MAX_REQUESTS", "4")
    from core.settings import get_settings

    get_settings.cache_clear()
    lines = [chat_line(f"r{i}", f"prompt number {i} " * (i + 1), max_tokens=3) for i in range(10)]
    batch_id = _validated(lines)
    shards = shard_rows(batch_id)
    assert len(shards) == 3
    tok = runtime.tokenizer(batch_row(batch_id).model)
    stored: dict[int, list[int]] = {}
    for shard in shards:
        part = read_prepared(storage(), batch_id, shard.index, tokenizer_fingerprint(tok))
        assert sorted(part) == list(range(shard.start_line, shard.end_line))
        stored.update(part)
    import json

    for n, line in enumerate(lines, start=1):
        data = json.dumps(line).encode()
        req = parse_request(
            RawLine(n, 0, len(data), data), endpoint=line["url"], served_models=None
        )
        assert stored[n] == prompt_token_ids(tok, req)


def test_the_shard_runs_on_the_stored_ids_and_without_them(worker_env, host) -> None:
    from worker.batches.finalize import finalize
    from worker.infra.task_io import storage
    from worker.shards.prepared import (
        prepared_key,
        read_prepared,
        tokenizer_fingerprint,
        write_prepared,
    )
    from worker.shards.task import ShardEnd, run_shard

    mark = tokenizer_fingerprint(host.tokenizer)  # the engine's, as the shard's run reads it
    lines = [chat_line(f"r{i}", f"say {i}", max_tokens=2) for i in range(6)]
    batch_id = _validated(lines)
    (shard,) = shard_rows(batch_id)
    original = read_prepared(storage(), batch_id, shard.index, mark)
    assert len(original) == 6  # validation's tokenizer and the engine's are the same
    stored = dict(original)
    # Line 1 is given 5 more prompt tokens than its text has, line 2 none at all (the
    # shard tokenizes it): the usage shows which ids each request ran on.
    stored[1] = stored[1] + stored[1][-5:]
    del stored[2]
    storage().delete(prepared_key(batch_id, shard.index))
    write_prepared(storage(), batch_id, shard.index, sorted(stored.items()), mark)
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    out = {r["custom_id"]: r for r in read_file_lines(batch_row(batch_id).output_file_id)}
    usage = {k: r["response"]["body"]["usage"]["prompt_tokens"] for k, r in out.items()}
    assert usage["r0"] == len(stored[1]) == len(original[1]) + 5  # the stored ids ran
    assert usage["r1"] == len(original[2])  # tokenized by the shard itself, as validation did
    assert all(usage[f"r{i}"] == len(original[i + 1]) for i in range(2, 6))
