"""An upstream model's lines through a batch's real validation and shard run, on real Postgres
and local storage: a field reserved to the operator fails the batch naming the line, unless
the upstream's spec allows it; each tenant's lines carry a salt of their own, and one tenant
cannot send another's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from testkit.builders.worker import MODEL, batch_row, chat_line, make_batch, shard_rows

pytestmark = pytest.mark.services

FLEET, OPEN = "fleet", "open"


class EchoServer:
    """An upstream dispatcher answering each request at once; it keeps the bodies sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def submit(self, path: str, body: dict[str, Any], *, callback: Any, **_: Any) -> None:
        from worker.upstream.dispatcher import Reply

        self.sent.append((path, body))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        answer: Future = Future()
        answer.set_result(Reply(200, {"object": "chat.completion", "usage": usage}))
        callback(answer)

    def abort_group(self, group: str) -> None:
        pass


@pytest.fixture
def models(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two upstream models (never reached: the test is their server), one that allows
    ``priority``, and a salt secret shared by every process."""
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_MODELS", json.dumps({
        MODEL: "demo:llama-tiny",
        FLEET: "upstream:http://127.0.0.1:9/v1?model=big",
        OPEN: "upstream:http://127.0.0.1:9/v1?model=big&allow_fields=priority",
    }))  # fmt: skip
    monkeypatch.setenv("BATCHD_CACHE_SALT_SECRET", "s" * 32)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _run(batch_id: str, tenant: str = "default") -> list[dict[str, Any]]:
    """Validate and run the batch as ``tenant``'s; the bodies its server was sent."""
    from core.database.sessions import session_scope
    from core.database.tables import Batch
    from worker.batches.tasks import validate
    from worker.shards.task import run_shard

    with session_scope() as session:
        session.get(Batch, batch_id).tenant = tenant
    assert validate(batch_id) == "in_progress"
    server = EchoServer()
    for shard in shard_rows(batch_id):
        run_shard(shard.id, host=server)
    return [body for _, body in server.sent]


def test_a_reserved_field_fails_the_batch_naming_the_line(models: None) -> None:
    from worker.batches.tasks import validate

    lines = [
        chat_line("a", "hi", model=FLEET),
        chat_line("b", "hi", model=FLEET, priority=-100),
        chat_line("c", "hi", model=FLEET, vllm_xargs={"k": 1}),
    ]
    batch_id = make_batch(lines)
    assert validate(batch_id) == "failed"
    errors = batch_row(batch_id).errors
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "unsupported_parameter", "body.priority"),
        (3, "unsupported_parameter", "body.vllm_xargs"),
    ]
    assert "overtake the live traffic" in errors[0]["message"]
    assert "allow_fields=priority" in errors[0]["message"]


def test_the_operator_allows_a_reserved_field_for_one_upstream(models: None) -> None:
    sent = _run(make_batch([chat_line("a", "hi", model=OPEN, priority=-100)]))
    assert [body["priority"] for body in sent] == [-100]


def test_each_tenant_its_own_salt_and_never_anothers(models: None) -> None:
    a = _run(make_batch([chat_line("a1", "hi", model=FLEET), chat_line("a2", "ho", model=FLEET)]),
             "tenant-a")  # fmt: skip
    b = _run(make_batch([chat_line("b1", "hi", model=FLEET)]), "tenant-b")
    a_salt = a[0]["cache_salt"]
    assert a[1]["cache_salt"] == a_salt  # a tenant's lines share its cache
    assert b[0]["cache_salt"] != a_salt
    # tenant b writes tenant a's salt as its own: what is sent is b's, not a's
    (forged,) = _run(make_batch([chat_line("b2", "hi", model=FLEET, cache_salt=a_salt,
                                           prompt_cache_key=a_salt)]), "tenant-b")  # fmt: skip
    assert a_salt not in (forged["cache_salt"], forged["prompt_cache_key"])
    assert forged["cache_salt"] != b[0]["cache_salt"]  # still b's to split as it likes


def test_with_one_cache_for_all_bodies_go_as_written(
    models: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_SHARE_PREFIX_CACHE_ACROSS_TENANTS", "true")
    get_settings.cache_clear()
    lines = [chat_line("a", "hi", model=FLEET), chat_line("b", "hi", model=FLEET, cache_salt="x")]
    sent = _run(make_batch(lines), "tenant-a")
    assert sent == [dict(line["body"], model="big") for line in lines]
