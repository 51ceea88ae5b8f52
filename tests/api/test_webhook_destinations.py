"""The webhook destination rule through the real API and the real delivery code, with loopback
receivers only: a loopback URL is refused at create time (400, no connection made) unless the
operator allows it; a delivery whose destination the allow-list no longer admits is refused
after resolution, without a request; the connection goes to the checked address; no redirect
is followed. Private, link-local and reserved addresses are covered by the pure unit tests in
tests/core/test_netcheck.py, never here."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


class Receiver:
    """A loopback HTTP server that records every connection and every request."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[dict[str, Any]] = []
        self.redirect_to: str | None = None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                receiver.connections += 1
                super().setup()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "body": body}
                )
                if receiver.redirect_to is not None:
                    self.send_response(307)
                    self.send_header("location", receiver.redirect_to)
                else:
                    self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def deliver(service_env, redis_url, monkeypatch) -> Iterator[Any]:
    """Record a batch's ``batch.completed`` event and make one delivery attempt in this
    process, as the control worker would, under this process's settings; returns the
    delivery row. Tasks the code enqueues go to the test Redis (nothing consumes them)."""
    from core.database.sessions import session_scope
    from core.database.tables import WebhookDelivery
    from core.settings import get_settings
    from worker.batches import webhooks
    from worker.events import notify
    from worker.infra.celery import app

    old_broker = app.conf.broker_url
    app.conf.broker_url = redis_url

    def run(batch_id: str, allowed: str | None = None, **attempt_options: Any) -> WebhookDelivery:
        if allowed is None:
            monkeypatch.delenv("BATCHD_WEBHOOK_ALLOWED_HOSTS", raising=False)
        else:
            monkeypatch.setenv("BATCHD_WEBHOOK_ALLOWED_HOSTS", allowed)
        get_settings.cache_clear()
        delivery_id = notify(batch_id, "completed")
        assert delivery_id is not None
        webhooks.attempt(delivery_id, **attempt_options)
        with session_scope() as session:
            row = session.get(WebhookDelivery, delivery_id)
            session.expunge(row)
        return row

    yield run
    app.conf.broker_url = old_broker
    get_settings.cache_clear()


def _create(client, **body: Any):
    input_file = client.files.create(file=("in.jsonl", LINES), purpose="batch").id
    return client.batches.create(input_file_id=input_file, **CREATE, extra_body=body)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.7.7.7", "localhost", "[::1]", "[::ffff:127.0.0.1]", "2130706433",
             "0x7f.1", "127.1"],
)  # fmt: skip
def test_loopback_url_is_refused_at_create_time(start_server, receiver, host):
    server = start_server()
    with pytest.raises(openai.BadRequestError) as caught:
        _create(server.client(), webhook_url=receiver.url("/hook", host))
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == "webhook_url"
    assert error["code"] == "webhook_url_not_allowed"
    assert "loopback" in error["message"] and "BATCHD_WEBHOOK_ALLOWED_HOSTS" in error["message"]
    assert receiver.connections == 0 and receiver.requests == []


def test_a_keys_default_webhook_url_is_checked_too(start_server, make_key, receiver):
    server = start_server()
    client = server.client(api_key=make_key(webhook_url=receiver.url("/default")))
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client)
    assert caught.value.body["param"] == "webhook_url"
    assert "the API key's default webhook URL" in caught.value.body["message"]
    assert receiver.connections == 0


def test_the_allow_list_admits_the_loopback_receiver(start_server, receiver, deliver):
    server = start_server(BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
    batch = _create(server.client(), webhook_url=receiver.url("/allowed"))
    assert batch.model_extra["webhook_url"] == receiver.url("/allowed")
    with pytest.raises(openai.BadRequestError):  # another loopback address is still refused
        _create(server.client(), webhook_url=receiver.url("/other", "127.0.0.2"))
    row = deliver(batch.id, allowed="127.0.0.1")
    assert (row.status, row.attempts, row.last_status_code) == ("delivered", 1, 200)
    assert [r["path"] for r in receiver.requests] == ["/allowed"]


def test_delivery_refuses_loopback_once_the_allow_list_is_removed(start_server, receiver, deliver):
    """Accepted at create time under the allow-list; the operator then removes it: the
    delivery checks the destination again and refuses it, without a request."""
    server = start_server(BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
    batch = _create(server.client(), webhook_url=receiver.url("/removed"))
    row = deliver(batch.id, allowed=None)
    assert (row.status, row.attempts, row.last_status_code) == ("failed", 1, None)
    assert row.last_error.startswith("refused: 127.0.0.1 is a loopback address")
    assert "BATCHD_WEBHOOK_ALLOWED_HOSTS" in row.last_error
    assert receiver.connections == 0 and receiver.requests == []


def test_delivery_resolves_once_checks_and_connects_to_the_checked_address(
    start_server, receiver, deliver
):
    """A name is checked after resolution and the request goes to the address that was
    checked, with the URL's host in the Host header. (The resolver is injected: no DNS.)"""
    lookups: list[tuple[str, int]] = []

    def resolver(host: str, port: int) -> list[str]:
        lookups.append((host, port))
        return ["127.0.0.1"]

    server = start_server(BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
    url = f"http://hooks.batchd.test:{receiver.port}/pinned"
    batch = _create(server.client(), webhook_url=url)  # a name: checked at delivery
    row = deliver(batch.id, allowed="127.0.0.1", resolver=resolver)
    assert row.status == "delivered"
    assert lookups == [("hooks.batchd.test", receiver.port)]
    (request,) = receiver.requests
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert headers["host"] == f"hooks.batchd.test:{receiver.port}"
    # The same name answering with loopback once the allow-list is gone: refused, no request.
    receiver.requests.clear()
    batch = _create(server.client(), webhook_url=url)
    row = deliver(batch.id, allowed=None, resolver=resolver)
    assert (
        row.status == "failed" and "hooks.batchd.test (127.0.0.1) is a loopback" in row.last_error
    )
    assert receiver.requests == []


def test_redirects_are_not_followed(start_server, receiver, deliver):
    server = start_server(BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.1")
    receiver.redirect_to = receiver.url("/elsewhere")
    batch = _create(server.client(), webhook_url=receiver.url("/redirecting"))
    row = deliver(batch.id, allowed="127.0.0.1")
    assert (row.status, row.last_status_code) == ("pending", 307)  # a failed attempt, retried
    assert [r["path"] for r in receiver.requests] == ["/redirecting"]


@pytest.mark.parametrize("host", ["2130706433", "127.1", "[::ffff:127.0.0.1]", "localhost"])
def test_stored_loopback_spellings_are_refused_at_delivery(start_server, receiver, deliver, host):
    """A URL accepted under an allow-list that has since been removed, in each spelling of
    loopback, is refused at delivery, with no connection made."""
    server = start_server(BATCHD_WEBHOOK_ALLOWED_HOSTS="127.0.0.0/8")
    batch = _create(server.client(), webhook_url=receiver.url("/x", host))
    row = deliver(batch.id, allowed=None)
    assert row.status == "failed" and row.last_error.startswith("refused:"), row.last_error
    assert "loopback" in row.last_error
    assert receiver.connections == 0
