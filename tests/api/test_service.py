"""Cross-cutting behaviour: auth, models, the error envelope, unavailable dependencies, and
that uploads stream instead of landing in the server's memory."""

from __future__ import annotations

import re

import openai
import pytest

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'


def _assert_envelope(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_static_keys_are_accepted_for_the_default_tenant(start_server):
    server = start_server(BATCHD_API_KEYS='["sk-first-static-key", "sk-second-static-key"]')
    with server.http(api_key=None) as http:
        error = _assert_envelope(http.get("/v1/models"), 401)
        assert "API key" in error["message"]
        _assert_envelope(
            http.get("/v1/files", headers={"authorization": "Basic c2stZmlyc3Q="}), 401
        )
        assert http.get("/healthz").status_code == 200  # healthchecks need no key
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client(api_key="sk-wrong").files.list()
    assert caught.value.body["code"] == "invalid_api_key"
    assert "sk-wrong" not in caught.value.body["message"]  # the key is masked
    for key in ("sk-first-static-key", "sk-second-static-key"):
        client = server.client(api_key=key)
        defaults = ["smollm2-135m-instruct", "minilm"]
        assert [m.id for m in client.models.list()] == defaults
        assert client.files.create(file=("a.jsonl", LINES), purpose="batch").bytes == len(LINES)


def test_models(start_server):
    server = start_server(BATCHD_MODELS='{"tiny": "demo:llama-25m", "org/other": "/models/other"}')
    client = server.client()
    listed = client.models.list()
    assert sorted(m.id for m in listed) == ["org/other", "tiny"]
    assert all(m.object == "model" and m.owned_by == "batchd" and m.created > 0 for m in listed)
    assert client.models.retrieve("org/other").id == "org/other"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["message"] == "No such Model object: gpt-4o"


def test_bad_input_gets_the_envelope_never_422(server):
    with server.http() as http:
        cases = [
            (http.get("/v1/files", params={"limit": "many"}), 400, "limit"),
            (http.get("/v1/files", params={"order": "sideways"}), 400, "order"),
            (http.get("/v1/batches", params={"limit": "0"}), 400, "limit"),
            (http.post("/v1/batches", json=[1, 2]), 400, None),
            (
                http.post(
                    "/v1/batches",
                    json={
                        "input_file_id": 7,
                        "endpoint": "/v1/completions",
                        "completion_window": "24h",
                    },
                ),
                400,
                "input_file_id",
            ),
            (
                http.post(
                    "/v1/batches",
                    json={
                        "input_file_id": "file-x",
                        "endpoint": "/v1/completions",
                        "completion_window": "24h",
                        "metadata": [],
                    },
                ),
                400,
                "metadata",
            ),
            (http.get("/v1/files/file-nope"), 404, None),
            (http.get("/v1/batches/batch_nope"), 404, None),
            (http.get("/v1/nothing-here"), 404, None),
            (http.put("/v1/files"), 405, None),
        ]
        for response, status, param in cases:
            error = _assert_envelope(response, status)
            if param is not None:
                assert error["param"] == param, error
        assert http.get("/openapi.json").status_code == 200
    # The server fixture also checks that none of this reached the catch-all 500 handler.


def test_openapi_document_is_valid(server):
    from openapi_spec_validator import validate

    with server.http() as http:
        document = http.get("/openapi.json").json()
    validate(document)
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (method, path)


def test_database_unavailable_is_503(start_server, closed_port):
    closed = closed_port
    server = start_server(
        BATCHD_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{closed}/nothing"
    )
    client = server.client()
    with server.http() as http:
        error = _assert_envelope(http.get("/healthz"), 503)
    assert "database" in error["message"].lower()
    assert "Traceback" not in error["message"]
    for call in (
        client.files.list,
        lambda: client.files.retrieve("file-x"),
        lambda: client.batches.retrieve("batch_x"),
        lambda: client.files.create(file=("a.jsonl", LINES), purpose="batch"),
    ):
        with pytest.raises(openai.InternalServerError) as caught:
            call()
        assert caught.value.status_code == 503
        assert caught.value.body["code"] == "database_unavailable"
    from core.storage import open_storage

    assert open_storage(server.storage_url).list("") == []  # the upload's bytes were dropped


def test_broker_unavailable_fails_the_batch_with_503(start_server, closed_port):
    closed = closed_port
    server = start_server(BATCHD_BROKER_URL=f"redis://127.0.0.1:{closed}/0")
    client = server.client()
    input_file = client.files.create(file=("a.jsonl", LINES), purpose="batch").id
    with pytest.raises(openai.InternalServerError) as caught:
        client.batches.create(
            input_file_id=input_file, endpoint="/v1/completions", completion_window="24h"
        )
    assert caught.value.status_code == 503
    assert "broker" in caught.value.body["message"]
    batch_id = re.search(r"batch_[0-9a-f]+", caught.value.body["message"]).group(0)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "failed"
    assert batch.failed_at is not None
    assert batch.errors.data[0].code == "broker_unavailable"


def test_a_create_refused_for_the_broker_releases_its_idempotency_key(start_server, closed_port):
    """A 503 asks the client to retry: the retry under the same key must make a batch that
    runs, not replay the failed one for good."""
    down = start_server(BATCHD_BROKER_URL=f"redis://127.0.0.1:{closed_port}/0").client()
    input_file = down.files.create(file=("a.jsonl", LINES), purpose="batch").id
    key = {"Idempotency-Key": "nightly-2026-12-03"}
    with pytest.raises(openai.InternalServerError):
        down.batches.create(input_file_id=input_file, endpoint="/v1/completions",
                            completion_window="24h", extra_headers=key)  # fmt: skip
    failed = down.batches.list().data[0].id
    up = start_server().client()
    retried = up.batches.create(input_file_id=input_file, endpoint="/v1/completions",
                                completion_window="24h", extra_headers=key)  # fmt: skip
    assert retried.id != failed and retried.status == "validating"
    again = up.batches.create(input_file_id=input_file, endpoint="/v1/completions",
                              completion_window="24h", extra_headers=key)  # fmt: skip
    assert again.id == retried.id  # from now on the key is the running batch's


def test_upload_streams_without_buffering_in_memory(server):
    """A 50 MB upload must not raise the server's peak RSS by anything like 50 MB."""
    client = server.client(timeout=120)
    client.files.create(file=("warm.jsonl", b"w" * (4 << 20)), purpose="batch")  # warm code paths
    before = server.status("VmHWM")
    size = 50 << 20
    created = client.files.create(file=("big.jsonl", b"b" * size), purpose="batch")
    peak_growth = server.status("VmHWM") - before
    assert created.bytes == size
    assert peak_growth < 30 << 20, f"peak RSS grew by {peak_growth / 2**20:.1f} MiB"
    # and the download streams back the same bytes
    with server.http() as http, http.stream("GET", f"/v1/files/{created.id}/content") as response:
        total = sum(len(chunk) for chunk in response.iter_bytes())
    assert total == size
    assert server.status("VmHWM") - before < 30 << 20
