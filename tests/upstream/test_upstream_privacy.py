"""Against a real OpenAI-compatible server that batchd did not write (``transformers serve`` on
SmolLM2-135M-Instruct), through a loopback proxy that records every body it is sent: each
tenant's lines reach the server with a salt of their own, a tenant cannot send another's, and
a key the server quotes in its error reaches the tenant redacted. The lines go the shard's way:
the upstream handler prepares them, the dispatcher sends them, the handler reads the answer."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from core.batchfile.reader import RawLine, parse_request
from core.batchfile.request import CHAT_URL
from core.database.tables import Batch
from core.llms.specs import forwarded_models, upstream_spec
from testkit.proxies.fault_proxy import FaultProxy
from testkit.upstream_server import UpstreamServer

pytestmark = pytest.mark.slow

SECRET = "the-operators-salt-secret-0123456789"
FAKE_KEY = "sk-proj-Zq81nWb4Kc7TyR2mXv9LpQ0dFg6HsJ3a"


@pytest.fixture(scope="module")
def proxied(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[UpstreamServer, FaultProxy]]:
    with UpstreamServer(tmp_path_factory.mktemp("privacy")) as server:
        proxy = FaultProxy(f"http://127.0.0.1:{server.port}").start()
        try:
            yield server, proxy
        finally:
            proxy.close()


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))
    monkeypatch.setenv("BATCHD_CACHE_SALT_SECRET", SECRET)
    monkeypatch.delenv("BATCHD_SHARE_PREFIX_CACHE_ACROSS_TENANTS", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _send(
    proxied: tuple[UpstreamServer, FaultProxy], options: str, lines: list[tuple[str, dict]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Send ``(tenant, extra body fields)`` lines as the shards of each tenant's batch do;
    for each, the body the server received and the line the tenant gets back."""
    from worker.upstream.dispatcher import Dispatcher
    from worker.upstream.handler import UpstreamHandler

    server, proxy = proxied
    served = f"upstream:{proxy.url}/v1?model={server.model}{options}"
    spec = upstream_spec(served, "fleet")
    dispatcher = Dispatcher("fleet", spec, shared=False).start()
    results = []
    answers: queue.Queue[Future] = queue.Queue()
    try:
        for n, (tenant, extra) in enumerate(lines):
            body = {"model": "fleet", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": "Say hi."}], **extra}  # fmt: skip
            data = json.dumps({"custom_id": f"r{n}", "method": "POST", "url": CHAT_URL,
                               "body": body}).encode()  # fmt: skip
            req = parse_request(RawLine(n + 1, 0, len(data) + 1, data), endpoint=CHAT_URL,
                                served_models=["fleet"],
                                forwarded=forwarded_models({"fleet": served}))  # fmt: skip
            batch = Batch(id=f"batch_{tenant}_{n}", tenant=tenant, priority="normal")
            handler = UpstreamHandler(batch, dispatcher, spec)
            before = len(proxy.received)
            prompt, params = handler.prepare(req)
            handler.submit(prompt, params, answers.put)
            outcome: Any = handler.outcome(req, answers.get(timeout=120), None)
            (received,) = [json.loads(b) for _, b in proxy.received[before:]]
            results.append((received, outcome.record))
    finally:
        dispatcher.shutdown()
    return results


def test_each_tenant_reaches_the_server_with_a_salt_of_its_own(
    proxied: tuple[UpstreamServer, FaultProxy], settings: None
) -> None:
    """This server takes OpenAI's fields only: the salt goes in ``prompt_cache_key``."""
    (a, a_line), (a2, _), (b, b_line) = _send(
        proxied,
        "&cache_salt_field=prompt_cache_key",
        [("tenant-a", {}), ("tenant-a", {}), ("tenant-b", {})],
    )
    assert a_line["response"]["status_code"] == 200, a_line
    assert b_line["response"]["status_code"] == 200, b_line
    a_key, b_key = a["prompt_cache_key"], b["prompt_cache_key"]
    assert a_key and b_key and a_key != b_key
    assert a2["prompt_cache_key"] == a_key  # a tenant's lines share its cache
    assert "cache_salt" not in a  # this server would refuse vLLM's field
    # tenant b, having learnt tenant a's key, writes it in its own line: b's is sent instead
    ((forged, forged_line),) = _send(
        proxied, "&cache_salt_field=prompt_cache_key", [("tenant-b", {"prompt_cache_key": a_key})]
    )
    assert forged_line["response"]["status_code"] == 200, forged_line
    assert forged["prompt_cache_key"] not in (a_key, b_key)


def test_vllms_field_carries_the_salt_by_default(
    proxied: tuple[UpstreamServer, FaultProxy], settings: None
) -> None:
    """By default the salt is vLLM's ``cache_salt``; a strict server such as this one refuses
    it (which is what ``cache_salt_field`` is for), but what was sent is what counts here."""
    (a, a_line), (b, _), (forged, _) = _send(
        proxied, "", [("tenant-a", {}), ("tenant-b", {}), ("tenant-b", {"cache_salt": "shared"})]
    )
    assert a["cache_salt"] != b["cache_salt"] and "prompt_cache_key" not in a
    assert forged["cache_salt"] not in ("shared", a["cache_salt"], b["cache_salt"])
    assert a_line["response"]["status_code"] == 422
    assert "cache_salt" in a_line["response"]["body"]["error"]["message"]


def test_with_one_cache_for_all_the_body_goes_as_written(
    proxied: tuple[UpstreamServer, FaultProxy], settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_SHARE_PREFIX_CACHE_ACROSS_TENANTS", "true")
    get_settings.cache_clear()
    ((sent, line),) = _send(
        proxied, "&cache_salt_field=prompt_cache_key", [("tenant-a", {"prompt_cache_key": "mine"})]
    )
    assert sent["prompt_cache_key"] == "mine"
    assert line["response"]["status_code"] == 200, line


def test_a_key_the_server_quotes_reaches_the_tenant_redacted(
    proxied: tuple[UpstreamServer, FaultProxy], settings: None
) -> None:
    """This server names the fields it refuses; a field named like a key (as a server quotes
    the key it was sent) comes back with the status and the message, the key redacted."""
    ((sent, line),) = _send(
        proxied, "&cache_salt_field=none", [("tenant-a", {FAKE_KEY: 1, "min_p": 0.1})]
    )
    assert FAKE_KEY in sent  # the server was sent it, and named it in its answer
    response = line["response"]
    assert response["status_code"] == 422
    message = response["body"]["error"]["message"]
    assert message.startswith("The upstream answered 422: Unexpected fields in the request")
    assert "min_p" in message and "[redacted]" in message
    assert FAKE_KEY not in json.dumps(line) and "Zq81nWb4" not in json.dumps(line)
