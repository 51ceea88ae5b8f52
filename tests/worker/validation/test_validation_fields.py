"""The accepted body fields through a batch's real validation and shard run, on real Postgres
and local storage: a local model's line with a field its endpoint does not accept fails the
batch naming it; an upstream model's lines reach the server as written, fields this service
does not know and all (with their tenant's prefix-cache salt added)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
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

FLEET = "fleet"


@pytest.fixture
def models(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tiny local model beside an upstream one (never reached: the test is its server)."""
    from core.settings import get_settings

    monkeypatch.setenv(
        "BATCHD_MODELS",
        json.dumps({MODEL: "demo:llama-tiny", FLEET: "upstream:http://127.0.0.1:9/v1?model=big"}),
    )
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


class EchoServer:
    """An upstream dispatcher answering each request at once with the body it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def submit(self, path: str, body: dict[str, Any], *, callback: Any, **_: Any) -> None:
        from worker.upstream.dispatcher import Reply

        self.sent.append((path, body))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        answer: Future = Future()
        answer.set_result(Reply(200, {"object": "chat.completion", "usage": usage, "sent": body}))
        callback(answer)

    def abort_group(self, group: str) -> None:
        pass


def test_a_local_models_unknown_field_fails_the_batch_naming_it(models: None) -> None:
    from worker.batches.tasks import validate

    batch_id = make_batch([chat_line("a", "hi"), chat_line("b", "hi", max_tokns=3)])
    assert validate(batch_id) == "failed"
    assert batch_row(batch_id).errors == [
        {
            "code": "unknown_parameter",
            "message": "Unrecognized request argument supplied: max_tokns",
            "param": "body.max_tokns",
            "line": 2,
        }
    ]


def test_an_upstream_models_lines_reach_it_as_written(models: None) -> None:
    from worker.batches.finalize import finalize
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard
    from worker.validation.scan import scan_input

    lines = [
        chat_line("a", "hi", model=FLEET, max_tokns=3, vendor_knob={"x": [1]}),
        chat_line("b", "hi", model=FLEET, min_p=0.1, guided_choice=["x", "y"]),
    ]
    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress"
    server = EchoServer()
    for shard in shard_rows(batch_id):
        run_shard(shard.id, host=server)
    assert finalize(batch_id) == "completed"
    from core.settings import get_settings
    from worker.upstream.cache_salt import salt_key, tenant_salt

    salt = tenant_salt(salt_key(get_settings()), "default")  # each tenant its own prefix cache
    want = [dict(line["body"], model="big", cache_salt=salt) for line in lines]
    assert [body for _, body in server.sent] == want
    batch = batch_row(batch_id)
    out = read_file_lines(batch.output_file_id)
    assert [o["response"]["body"]["sent"] for o in out] == want
    assert read_file_lines(batch.error_file_id) == []

    # an estimate reads the file the same way; the local model's lines are checked in full
    from worker.infra.task_io import storage

    for model, errors in ((FLEET, []), (MODEL, [(1, "unknown_parameter")])):
        key = f"files/fields-{model}"
        with storage().writer(key) as f:
            f.write(json.dumps(chat_line("a", "hi", model=model, max_tokns=3)).encode() + b"\n")
        report = scan_input(key, "/v1/chat/completions").report
        assert [(e.line, e.code) for e in report.errors] == errors
