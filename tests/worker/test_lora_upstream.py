"""LoRA adapters an upstream server serves itself (``lora:<upstream model>``, as vLLM's
``--lora-modules``): through a batch's real validation and shard run on real Postgres and local
storage, each line reaches the server with ``model`` the adapter's name (or its
``upstream_name``), the base's lines with the base's, all in one batch on the base's queue."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.worker import MODEL, batch_row, chat_line, make_batch, shard_rows
from tests.worker.test_upstream_line_limits import EchoServer

pytestmark = pytest.mark.services

FLEET = "fleet"


@pytest.fixture
def models(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An upstream model (never reached: the test is its server) and two adapters it serves."""
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MODELS", json.dumps({
        MODEL: "demo:llama-tiny",
        FLEET: "upstream:http://127.0.0.1:9/v1?model=big&allow_fields=priority",
        "sql-bot": f"lora:{FLEET}",
        "support-bot": f"lora:{FLEET}?upstream_name=support-lora-v2",
    }))  # fmt: skip
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_adapter_lines_reach_the_upstream_under_the_adapters_names(models: None) -> None:
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard

    lines = [
        chat_line("s1", "hi", model="sql-bot"),
        chat_line("b1", "hi", model=FLEET),
        chat_line("h1", "hi", model="support-bot", priority=-5),  # the base's allow_fields
        chat_line("s2", "ho", model="sql-bot", some_server_field=1),  # forwarded as written
    ]
    batch_id = make_batch(lines)
    assert validate(batch_id) == "in_progress"
    assert batch_row(batch_id).model == FLEET  # one batch, on the base's queue
    server = EchoServer()
    for shard in shard_rows(batch_id):
        run_shard(shard.id, host=server)
    sent = [body for _, body in server.sent]
    assert [body["model"] for body in sent] == ["sql-bot", "big", "support-lora-v2", "sql-bot"]
    assert sent[2]["priority"] == -5 and sent[3]["some_server_field"] == 1
    row = batch_row(batch_id)
    assert (row.request_completed, row.request_failed) == (4, 0)


def test_an_adapter_of_another_model_cannot_share_the_batch(models: None) -> None:
    from worker.batches.tasks import validate

    batch_id = make_batch([chat_line("s", "hi", model="sql-bot"), chat_line("d", "hi")])
    assert validate(batch_id) == "failed"
    (error,) = batch_row(batch_id).errors
    assert (error["line"], error["code"], error["param"]) == (2, "mismatched_model", "body.model")
