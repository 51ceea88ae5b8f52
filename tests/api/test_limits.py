"""Backpressure at the API: the unfinished-batch quota per tenant and the request rate per key
(shared through Redis by several API processes, in-process otherwise)."""

from __future__ import annotations

import openai
import pytest

from core.database.lifecycle import transition

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def _create(client, input_file: str, **kwargs):
    return client.batches.create(
        input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h", **kwargs
    )


def test_unfinished_batch_quota(start_server, make_key, pg_url):
    from core.database.sessions import session_scope

    server = start_server(BATCHD_MAX_UNFINISHED_BATCHES_PER_TENANT="2")
    client = server.client()
    input_file = client.files.create(file=("in.jsonl", LINES), purpose="batch").id
    first = _create(client, input_file, extra_headers={"Idempotency-Key": "first"})
    second = _create(client, input_file)
    with pytest.raises(openai.RateLimitError) as caught:
        _create(client, input_file)
    error = caught.value.body
    assert error["code"] == "unfinished_batch_limit_exceeded"
    assert "limit is 2" in error["message"]
    assert caught.value.response.headers["x-should-retry"] == "false"
    # Replaying a create that already happened is not a new batch: it still answers.
    assert _create(client, input_file, extra_headers={"Idempotency-Key": "first"}).id == first.id

    # Another tenant has its own count.
    other = server.client(api_key=make_key())
    other_file = other.files.create(file=("in.jsonl", LINES), purpose="batch").id
    assert _create(other, other_file).status == "validating"

    # A cancelling batch is still unfinished; a cancelled one frees its slot.
    client.batches.cancel(second.id)
    with pytest.raises(openai.RateLimitError):
        _create(client, input_file)
    with session_scope(pg_url) as session:
        assert transition(session, second.id, "cancelling", "cancelled")
    assert _create(client, input_file).status == "validating"


def _hit(server, key: str | None = None) -> tuple[int, dict[str, str]]:
    with server.http(api_key=key or server.api_key) as http:
        response = http.get("/v1/models")
    return response.status_code, dict(response.headers)


def _assert_limited(status: int, headers: dict[str, str]) -> None:
    assert status == 429
    retry_after = int(headers["retry-after"])
    assert 1 <= retry_after <= 20  # 3 a minute: one token every 20 s


def test_rate_limit_per_key_is_shared_by_api_processes(start_server, make_key):
    first = start_server(BATCHD_RATE_LIMIT_PER_MINUTE="3")
    second = start_server(BATCHD_RATE_LIMIT_PER_MINUTE="3")
    assert _hit(first)[0] == 200
    assert _hit(second)[0] == 200
    assert _hit(first)[0] == 200
    _assert_limited(*_hit(second))  # the bucket lives in Redis, not in either process
    _assert_limited(*_hit(first))

    with first.http() as http:
        body = http.get("/v1/files").json()
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert "3 requests per minute" in body["error"]["message"]

    other = make_key()  # another key has its own bucket
    assert _hit(first, other)[0] == 200
    with first.http() as http:  # healthchecks are never limited
        assert http.get("/healthz").status_code == 200


@pytest.mark.parametrize("broker", ["embedded", "redis-down"])
def test_rate_limit_without_redis_is_in_process(start_server, tmp_path, closed_port, broker):
    url = (
        f"sqla+sqlite:///{tmp_path / 'broker.db'}"
        if broker == "embedded"
        else f"redis://127.0.0.1:{closed_port}/0"
    )
    server = start_server(BATCHD_RATE_LIMIT_PER_MINUTE="3", BATCHD_BROKER_URL=url)
    assert [_hit(server)[0] for _ in range(3)] == [200, 200, 200]
    _assert_limited(*_hit(server))


def test_rate_limit_zero_disables_it(start_server):
    server = start_server(BATCHD_RATE_LIMIT_PER_MINUTE="0")
    assert {_hit(server)[0] for _ in range(20)} == {200}


def test_wrong_keys_are_throttled_per_address(start_server, api_key):
    """Guessing keys at line rate: after auth_failures_per_minute wrong keys an address gets
    429 on every path that takes a key, even with a right key, until its bucket refills."""
    server = start_server(BATCHD_AUTH_FAILURES_PER_MINUTE="3", BATCHD_RATE_LIMIT_PER_MINUTE="0")
    with server.http(api_key="sk-guess-0000") as guess:
        assert [guess.get("/v1/models").status_code for _ in range(3)] == [401, 401, 401]
        refused = guess.get("/v1/models")
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert guess.get("/ui/data").status_code == 429  # the dashboard's bearer path too
    with server.http(api_key=api_key) as right:
        assert right.get("/v1/models").status_code == 429  # not looked at while blocked
