"""Tenants: every file and batch belongs to the caller's tenant, and another tenant's objects
answer exactly like missing ones on every route. Expired files answer like missing ones too."""

from __future__ import annotations

from datetime import timedelta

import openai
import pytest

from core.database.lifecycle import now

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
MISSING_FILE = "file-" + "0" * 24
MISSING_BATCH = "batch_" + "0" * 24


def _error(http, method: str, path: str, **kwargs) -> tuple[int, dict]:
    response = http.request(method, path, **kwargs)
    return response.status_code, response.json()


def _same_as_missing(http, method: str, path: str, real_id: str, missing_id: str, **kwargs):
    """The answer for ``real_id`` equals the answer for ``missing_id``, ids aside."""
    status, body = _error(http, method, path.format(id=real_id), **kwargs)
    kwargs_missing = {
        k: (
            {**v, "input_file_id": missing_id}
            if isinstance(v, dict) and "input_file_id" in v
            else v
        )
        for k, v in kwargs.items()
    }
    m_status, m_body = _error(http, method, path.format(id=missing_id), **kwargs_missing)
    assert status == m_status, (method, path, body, m_body)
    assert status in (400, 404), (method, path, body)
    assert str(body).replace(real_id, "ID") == str(m_body).replace(missing_id, "ID")


def test_another_tenants_objects_answer_404_on_every_route(server, make_key):
    owner = server.client()
    intruder_key = make_key()
    file = owner.files.create(file=("in.jsonl", LINES), purpose="batch")
    batch = owner.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    intruder = server.client(api_key=intruder_key)
    assert file.id not in [f.id for f in intruder.files.list()]
    assert batch.id not in [b.id for b in intruder.batches.list()]

    create = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with server.http(api_key=intruder_key) as http:
        for method, path, missing in [
            ("GET", "/v1/files/{id}", MISSING_FILE),
            ("GET", "/v1/files/{id}/content", MISSING_FILE),
            ("DELETE", "/v1/files/{id}", MISSING_FILE),
            ("GET", "/v1/batches/{id}", MISSING_BATCH),
            ("POST", "/v1/batches/{id}/cancel", MISSING_BATCH),
        ]:
            _same_as_missing(
                http, method, path, (file.id if "files" in path else batch.id), missing
            )
        # Someone else's file as a batch's input.
        _same_as_missing(
            http, "POST", "/v1/batches", file.id, MISSING_FILE,
            json={**create, "input_file_id": file.id},
        )  # fmt: skip
        status, body = _error(
            http, "POST", "/v1/batches", json={**create, "input_file_id": file.id}
        )
        assert (status, body["error"]["param"]) == (404, "input_file_id")
        # Someone else's object as a pagination cursor.
        for path, real in (("/v1/files", file.id), ("/v1/batches", batch.id)):
            s1, b1 = _error(http, "GET", path, params={"after": real})
            s2, b2 = _error(http, "GET", path, params={"after": "x-missing"})
            assert s1 == s2 == 400
            assert b1["error"]["message"].replace(real, "ID") == b2["error"]["message"].replace(
                "x-missing", "ID"
            )

    # Nothing the intruder did touched the owner's objects.
    assert owner.files.retrieve(file.id) == file
    assert owner.files.content(file.id).read() == LINES
    assert owner.batches.retrieve(batch.id).status == "validating"
    assert [b.id for b in owner.batches.list()] == [batch.id]
    assert [f.id for f in owner.files.list()] == [file.id]


def test_static_keys_belong_to_the_default_tenant(start_server, make_key):
    server = start_server(BATCHD_API_KEYS="sk-static-key-one")
    static = server.client(api_key="sk-static-key-one")
    default_tenant_key = make_key(tenant="default")
    other = server.client()  # this test's own tenant
    file = static.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert server.client(api_key=default_tenant_key).files.retrieve(file.id).id == file.id
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(file.id)


def test_auth_is_required_by_default_and_can_be_switched_off(start_server, make_key):
    server = start_server()
    with server.http(api_key=None) as http:
        response = http.get("/v1/files")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-bd-not-a-real-key").files.list()

    open_server = start_server(BATCHD_AUTH="off")
    with open_server.http(api_key=None) as http:
        assert http.get("/v1/files").status_code == 200


def _set_expiry(pg_url: str, file_id: str, delta: timedelta) -> None:
    from core.database.sessions import session_scope
    from core.database.tables import File

    with session_scope(pg_url) as session:
        session.get(File, file_id).expires_at = now() + delta


def test_expired_files_answer_404(server, client, pg_url):
    live = client.files.create(file=("live.jsonl", LINES), purpose="batch")
    gone = client.files.create(file=("gone.jsonl", LINES), purpose="batch")
    _set_expiry(pg_url, gone.id, timedelta(seconds=-1))

    assert [f.id for f in client.files.list()] == [live.id]
    for call in (
        lambda: client.files.retrieve(gone.id),
        lambda: client.files.content(gone.id),
        lambda: client.files.delete(gone.id),
        lambda: client.batches.create(
            input_file_id=gone.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["message"] == f"No such File object: {gone.id}"
    with pytest.raises(openai.BadRequestError):
        client.files.list(after=gone.id)
    assert client.files.retrieve(live.id).id == live.id


@pytest.mark.parametrize(
    ("expires_after", "expected_s"),
    [(None, 30 * 24 * 3600), (3600, 3600), (2_592_000, 2_592_000)],
)
def test_expires_after_bounds(client, expires_after, expected_s):
    extra = (
        {}
        if expires_after is None
        else {"expires_after": {"anchor": "created_at", "seconds": expires_after}}
    )
    created = client.files.create(file=("r.jsonl", LINES), purpose="batch", **extra)
    assert created.expires_at - created.created_at == expected_s


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"},
            "expires_after.seconds",
        ),
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
            "expires_after.seconds",
        ),
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"},
            "expires_after.seconds",
        ),
        (
            {"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
            "expires_after.anchor",
        ),
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
    ],
)
def test_bad_expires_after_is_400(server, fields, param):
    with server.http() as http:
        response = http.post(
            "/v1/files",
            data={"purpose": "batch", **fields},
            files={"file": ("r.jsonl", LINES)},
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
