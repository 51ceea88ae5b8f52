"""LoRA adapters an upstream server serves itself (``lora:<upstream model>``, as vLLM's
``--lora-modules``): through a batch's real validation and shard run on real Postgres and local
storage, each line reaches the server with ``model`` the adapter's name (or its
``upstream_name``), the base's lines with the base's, all in one batch on the base's queue."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from testkit.builders.worker import MODEL, batch_row, chat_line, make_batch, shard_rows
from testkit.proxies.fault_proxy import FaultProxy
from testkit.upstream_server import UpstreamServer
from tests.worker.upstream.test_upstream_line_limits import EchoServer

pytestmark = pytest.mark.services

FLEET = "fleet"
SALT_FIELD = "cache_salt_field=prompt_cache_key"


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


@pytest.mark.slow
def test_a_real_server_receives_each_adapters_name(
    worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Against ``transformers serve`` (a server batchd did not write) through a loopback proxy
    that records every body: the shard's lines go out through the real dispatcher, each with
    the ``model`` its adapter is served under. This server serves one model (its directory):
    the adapter renamed to it is answered, the one sent under its own name is the server's to
    refuse, and its line carries that refusal."""
    from core.llms.specs import upstream_spec
    from core.settings import get_settings
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard
    from worker.upstream.dispatcher import Dispatcher

    with UpstreamServer(tmp_path) as server:
        proxy = FaultProxy(f"http://127.0.0.1:{server.port}").start()
        try:
            # this server refuses vLLM's cache_salt: the salt goes in prompt_cache_key
            base = f"upstream:{proxy.url}/v1?model={quote(server.model)}&" + SALT_FIELD
            monkeypatch.setenv("BATCHD_MODELS", json.dumps({
                FLEET: base,
                "support-bot": f"lora:{FLEET}?upstream_name={quote(server.model)}",
                "sql-bot": f"lora:{FLEET}",
            }))  # fmt: skip
            get_settings.cache_clear()
            params = {"max_tokens": 2, "temperature": 0}
            lines = [
                chat_line(name, f"Say hi to {name}.", model=model, **params)
                for name, model in [("base", FLEET), ("support", "support-bot"), ("sql", "sql-bot")]
            ]
            batch_id = make_batch(lines)
            assert validate(batch_id) == "in_progress"
            dispatcher = Dispatcher(FLEET, upstream_spec(base, FLEET), shared=False).start()
            try:
                for shard in shard_rows(batch_id):
                    run_shard(shard.id, host=dispatcher)
            finally:
                dispatcher.shutdown()
            bodies = [json.loads(body) for _, body in proxy.received]
            assert {b["messages"][0]["content"]: b["model"] for b in bodies} == {
                "Say hi to base.": server.model,
                "Say hi to support.": server.model,
                "Say hi to sql.": "sql-bot",
            }
            row = batch_row(batch_id)
            assert (row.request_completed, row.request_failed) == (2, 1)
        finally:
            proxy.close()
