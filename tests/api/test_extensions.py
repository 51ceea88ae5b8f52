"""Extensions to ``POST /v1/batches`` (idempotent create, priority, webhooks), as the official
client sends them through ``extra_headers`` / ``extra_body``; and hostile upload file names."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import httpx
import openai
import pytest

from core.broker.queue import TASK_VALIDATE

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.fixture
def input_file(client) -> str:
    return client.files.create(file=("in.jsonl", LINES), purpose="batch").id


def _create(client, input_file: str, **kwargs):
    return client.batches.create(input_file_id=input_file, **CREATE, **kwargs)


def _batch_row(pg_url: str, batch_id: str):
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope(pg_url) as session:
        return session.get(Batch, batch_id)


def test_idempotency_key_returns_the_first_batch(
    server, client, input_file, make_key, control_messages
):
    first = _create(client, input_file, extra_headers={"Idempotency-Key": "job-42"})
    again = _create(client, input_file, extra_headers={"Idempotency-Key": "job-42"})
    assert again.id == first.id
    by_body = _create(client, input_file, extra_body={"idempotency_key": "job-42"})
    assert by_body.id == first.id
    assert [b.id for b in client.batches.list()] == [first.id]
    assert [m["args"] for m in control_messages(TASK_VALIDATE)].count([first.id]) == 1

    # The key is per tenant.
    other = server.client(api_key=make_key())
    other_file = other.files.create(file=("in.jsonl", LINES), purpose="batch").id
    theirs = _create(other, other_file, extra_headers={"Idempotency-Key": "job-42"})
    assert theirs.id != first.id

    # The same key for a different request is a conflict, not a silent replay.
    second_file = client.files.create(file=("in2.jsonl", LINES), purpose="batch").id
    with pytest.raises(openai.ConflictError) as caught:
        _create(client, second_file, extra_headers={"Idempotency-Key": "job-42"})
    assert caught.value.body["code"] == "idempotency_key_reused"
    assert first.id in caught.value.body["message"]
    with pytest.raises(openai.ConflictError):
        client.batches.create(
            input_file_id=input_file,
            endpoint="/v1/completions",
            completion_window="24h",
            extra_headers={"Idempotency-Key": "job-42"},
        )

    # So is the same key with any other parameter that shapes the batch.
    for changed in ({"completion_window": "48h"}, {"metadata": {"run": "2"}}):
        with pytest.raises(openai.ConflictError) as caught:
            client.batches.create(**{"input_file_id": input_file, **CREATE, **changed},
                                  extra_headers={"Idempotency-Key": "job-42"})  # fmt: skip
        assert next(iter(changed)) in caught.value.body["message"]

    with pytest.raises(openai.BadRequestError) as caught:
        _create(
            client,
            input_file,
            extra_headers={"Idempotency-Key": "a"},
            extra_body={"idempotency_key": "b"},
        )
    assert caught.value.body["param"] == "idempotency_key"
    with pytest.raises(openai.BadRequestError):
        _create(client, input_file, extra_headers={"Idempotency-Key": "k" * 257})


def test_concurrent_creates_with_one_key_make_one_batch(server, input_file):
    def create(_i: int) -> httpx.Response:
        with server.http() as http:
            return http.post(
                "/v1/batches",
                json={**CREATE, "input_file_id": input_file},
                headers={"Idempotency-Key": "race"},
            )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(create, range(8)))
    assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(server.client().batches.list().data) == 1


def _priority_refused(client, input_file: str, priority: str) -> dict:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        _create(client, input_file, extra_body={"priority": priority})
    assert caught.value.status_code == 403
    return caught.value.body


def test_priority_is_an_entitlement_of_the_key(server, client, input_file, make_key):
    """A fresh key may use normal and low; high is refused with 403 priority_not_allowed,
    naming the key's maximum."""
    default = _create(client, input_file)
    assert default.model_extra["priority"] == "normal"
    low = _create(client, input_file, extra_body={"priority": "low"})
    assert low.model_extra["priority"] == "low"
    refused = _priority_refused(client, input_file, "high")
    assert refused["code"] == "priority_not_allowed" and refused["param"] == "priority"
    assert refused["type"] == "invalid_request_error"
    assert "up to 'normal'" in refused["message"] and "'high'" in refused["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, extra_body={"priority": "urgent"})
    assert caught.value.body["param"] == "priority"
    assert {b.model_extra["priority"] for b in client.batches.list()} == {"normal", "low"}

    # A key created with max_priority high may use it.
    granted = server.client(api_key=make_key(max_priority="high"))
    granted_file = granted.files.create(file=("in.jsonl", LINES), purpose="batch").id
    high = _create(granted, granted_file, extra_body={"priority": "high"})
    assert high.model_extra["priority"] == "high"
    assert granted.batches.retrieve(high.id).model_extra["priority"] == "high"

    # A key limited to low: low always works, and a create that names no priority gets low.
    limited = server.client(api_key=make_key(max_priority="low"))
    limited_file = limited.files.create(file=("in.jsonl", LINES), purpose="batch").id
    assert _create(limited, limited_file).model_extra["priority"] == "low"
    assert "up to 'low'" in _priority_refused(limited, limited_file, "normal")["message"]


def test_admin_and_static_keys_priorities(start_server):
    """An admin key (BATCHD_ADMIN_API_KEYS) may use any priority; a static BATCHD_API_KEYS
    key is an ordinary key (normal at most)."""
    server = start_server(BATCHD_ADMIN_API_KEYS="sk-test-admin-priority")
    admin = server.client(api_key="sk-test-admin-priority")
    admin_file = admin.files.create(file=("in.jsonl", LINES), purpose="batch").id
    for priority in ("high", "normal", "low"):
        created = _create(admin, admin_file, extra_body={"priority": priority})
        assert created.model_extra["priority"] == priority
    static = server.client(api_key=server.env["BATCHD_API_KEYS"])
    static_file = static.files.create(file=("in.jsonl", LINES), purpose="batch").id
    assert _priority_refused(static, static_file, "high")["code"] == "priority_not_allowed"
    low = _create(static, static_file, extra_body={"priority": "low"})
    assert low.model_extra["priority"] == "low"


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/hook", "javascript:alert(1)", "https://", "/relative", "http://a b/",
     "https://example.com/\r\nX-Evil: 1", "http://example.com:99999/"],
)  # fmt: skip
def test_bad_webhook_urls_are_400(client, input_file, url):
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, extra_body={"webhook_url": url})
    assert caught.value.body["param"] == "webhook_url"


def test_webhooks_use_the_keys_url_and_secret(server, make_key, pg_url):
    from core.database.auth import lookup
    from core.database.sessions import session_scope

    key = make_key(webhook_url="https://hooks.example.com/default")
    client = server.client(api_key=key)
    with session_scope(pg_url) as session:
        key_secret = lookup(session, key).webhook_secret
    input_file = client.files.create(file=("in.jsonl", LINES), purpose="batch").id

    by_default = _create(client, input_file)
    assert by_default.model_extra["webhook_url"] == "https://hooks.example.com/default"
    assert by_default.model_extra["webhook_secret"] is None  # the client has the key's secret
    row = _batch_row(pg_url, by_default.id)
    assert (row.webhook_url, row.webhook_secret) == (
        "https://hooks.example.com/default",
        key_secret,
    )

    own = _create(
        client, input_file, extra_body={"webhook_url": "http://hooks.example.net:8080/done?x=1"}
    )
    assert own.model_extra["webhook_url"] == "http://hooks.example.net:8080/done?x=1"
    assert _batch_row(pg_url, own.id).webhook_secret == key_secret


def test_no_webhook_unless_asked(client, input_file, pg_url):
    batch = _create(client, input_file)
    assert batch.model_extra["webhook_url"] is None
    row = _batch_row(pg_url, batch.id)
    assert (row.webhook_url, row.webhook_secret) == (None, None)


def test_static_keys_get_a_secret_per_batch_shown_once(start_server, pg_url):
    server = start_server(BATCHD_API_KEYS="sk-static-key-of-default")
    client = server.client(api_key="sk-static-key-of-default")
    input_file = client.files.create(file=("in.jsonl", LINES), purpose="batch").id
    batch = _create(
        client,
        input_file,
        extra_body={"webhook_url": "https://hooks.example.com/x"},
        extra_headers={"Idempotency-Key": "static-1"},
    )
    secret = batch.model_extra["webhook_secret"]
    assert secret.startswith("whsec_")
    assert _batch_row(pg_url, batch.id).webhook_secret == secret
    assert client.batches.retrieve(batch.id).model_extra["webhook_secret"] is None
    assert all(b.model_extra["webhook_secret"] is None for b in client.batches.list())
    replay = _create(
        client,
        input_file,
        extra_body={"webhook_url": "https://hooks.example.com/x"},
        extra_headers={"Idempotency-Key": "static-1"},
    )
    assert replay.model_extra["webhook_secret"] == secret  # the creator retrying learns it too


def _multipart(filename: bytes) -> tuple[bytes, str]:
    boundary = b"b0undary"
    body = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="'
        + filename + b'"\r\n\r\n' + LINES + b"\r\n--" + boundary + b"--\r\n"
    )  # fmt: skip
    return body, "multipart/form-data; boundary=b0undary"


HOSTILE_NAMES = [
    b"../../../etc/passwd",
    b"..",
    b"C:\\Windows\\System32\\evil.jsonl",
    b"a/b/../../c.jsonl",
    b"name\x00with\x01nul.jsonl",
    b"tab\there\x7f.jsonl",
    b'quote\\"; filename=other.jsonl',
    b"semi;colon=x.jsonl",
    b"pct%0d%0aSet-Cookie: x=1.jsonl",
    "caf\u00e9 \u202eexe.jsonl \u2028".encode(),
    b"\xff\xfe not utf-8.jsonl",
    b"   ",
]
SAFE_DISPOSITION = re.compile(
    r"""attachment; filename="[\x20-\x7e]*"; filename\*=UTF-8''[A-Za-z0-9%\-_.~]*"""
)


@pytest.mark.parametrize("raw", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_hostile_file_names_are_stored_harmlessly(server, raw):
    body, ctype = _multipart(raw)
    with server.http() as http:
        response = http.post("/v1/files", content=body, headers={"content-type": ctype})
        assert response.status_code == 200, response.text
        created = response.json()
        name = created["filename"]
        download = http.get(f"/v1/files/{created['id']}/content")
    assert name and name not in (".", "..")
    assert not set(name) & {"/", "\\"}
    assert not any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in name)
    assert "\u202e" not in name and "\u2028" not in name
    assert download.content == LINES
    disposition = download.headers["content-disposition"]
    assert SAFE_DISPOSITION.fullmatch(disposition), disposition
    fallback = disposition.split('filename="', 1)[1].split('"', 1)[0]
    assert not set(fallback) & {'"', "\\", ";"}
    assert unquote(disposition.split("filename*=UTF-8''", 1)[1]) == name
    assert download.headers["x-content-type-options"] == "nosniff"
