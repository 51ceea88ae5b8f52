"""The Files API through the official client and raw HTTP: round trip, limits, pagination."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from core.storage import open_storage

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 3


def _stored_files(storage_url: str) -> list[str]:
    """Every file under the storage root, temporary ones included."""
    found = []
    for root, _dirs, names in os.walk(storage_url):
        found += [str(Path(root, name)) for name in names]
    return found


def test_upload_list_retrieve_content_delete(server, client):
    created = client.files.create(file=("requests.jsonl", LINES), purpose="batch")
    assert created.id.startswith("file-")
    assert created.object == "file"
    assert created.bytes == len(LINES)
    assert created.filename == "requests.jsonl"
    assert created.purpose == "batch"
    assert created.status == "processed"
    assert created.status_details is None
    assert created.expires_at - created.created_at == 30 * 24 * 3600

    storage = open_storage(server.storage_url)
    assert storage.exists(f"files/{created.id}")

    assert client.files.retrieve(created.id) == created
    assert created.id in [f.id for f in client.files.list(purpose="batch")]
    assert created.id not in [f.id for f in client.files.list(purpose="batch_output")]

    content = client.files.content(created.id)
    assert content.read() == LINES
    assert content.response.headers["content-type"].startswith("application/jsonl")
    assert content.response.headers["content-length"] == str(len(LINES))

    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    assert not storage.exists(f"files/{created.id}")
    with pytest.raises(openai.NotFoundError) as caught:
        client.files.retrieve(created.id)
    assert caught.value.body["message"] == f"No such File object: {created.id}"
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(created.id)


def test_expires_after_is_honoured(client):
    created = client.files.create(
        file=("r.jsonl", LINES),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert created.expires_at - created.created_at == 7200
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(
            file=("r.jsonl", LINES),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 10},
        )
    assert caught.value.body["param"] == "expires_after.seconds"


def _multipart(
    parts: list[tuple[bytes, bytes]], boundary: bytes = b"XyZbOuNdArY"
) -> tuple[bytes, str]:
    body = b""
    for disposition, data in parts:
        body += (
            b"--"
            + boundary
            + b"\r\nContent-Disposition: "
            + disposition
            + b"\r\n\r\n"
            + data
            + b"\r\n"
        )
    body += b"--" + boundary + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary.decode()}"


def test_filename_is_sanitised_and_download_header_is_safe(server):
    body, ctype = _multipart(
        [
            (b'form-data; name="purpose"', b"batch"),
            (
                b'form-data; name="file"; filename="../../etc/\\win\\ev\x07il\x1b\xc3\xa9.jsonl"',
                LINES,
            ),
        ]
    )
    with server.http() as http:
        response = http.post("/v1/files", content=body, headers={"content-type": ctype})
        assert response.status_code == 200, response.text
        created = response.json()
        assert created["filename"] == "evil\u00e9.jsonl"
        download = http.get(f"/v1/files/{created['id']}/content")
    assert download.content == LINES
    disposition = download.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="evil_.jsonl"')
    assert "filename*=UTF-8''evil%C3%A9.jsonl" in disposition


@pytest.mark.parametrize(
    ("parts", "param"),
    [
        ([(b'form-data; name="file"; filename="a.jsonl"', LINES)], "purpose"),
        ([(b'form-data; name="purpose"', b"batch")], "file"),
        (
            [
                (b'form-data; name="purpose"', b"fine-tune"),
                (b'form-data; name="file"; filename="a.jsonl"', LINES),
            ],
            "purpose",
        ),
        (
            [
                (b'form-data; name="file"; filename="a.jsonl"', LINES),
                (b'form-data; name="file"; filename="b.jsonl"', LINES),
                (b'form-data; name="purpose"', b"batch"),
            ],
            "file",
        ),
    ],
)
def test_bad_upload_fields_are_400_and_store_nothing(server, parts, param):
    body, ctype = _multipart(parts)
    with server.http() as http:
        response = http.post("/v1/files", content=body, headers={"content-type": ctype})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert _stored_files(server.storage_url) == []


def test_malformed_bodies_are_400(server):
    with server.http() as http:
        not_multipart = http.post("/v1/files", json={"purpose": "batch"})
        body, ctype = _multipart([(b'form-data; name="file"; filename="a.jsonl"', LINES)])
        truncated = http.post("/v1/files", content=body[:-40], headers={"content-type": ctype})
    for response in (not_multipart, truncated):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
    assert _stored_files(server.storage_url) == []


LIMIT = 1000


def test_upload_over_the_limit_is_413_and_leaves_nothing(start_server):
    server = start_server(BATCHD_MAX_UPLOAD_BYTES=str(LIMIT))
    client = server.client()
    exactly = client.files.create(file=("ok.jsonl", b"x" * LIMIT), purpose="batch")
    assert exactly.bytes == LIMIT

    # Declared length fits the multipart allowance, the file part does not: caught mid-stream.
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (LIMIT + 1)), purpose="batch")
    assert caught.value.status_code == 413
    assert caught.value.body["param"] == "file"

    body, ctype = _multipart(
        [
            (b'form-data; name="purpose"', b"batch"),
            (b'form-data; name="file"; filename="c.jsonl"', b"y" * 5000),
        ]
    )
    with server.http() as http:
        # No Content-Length (chunked): only the streamed count can catch it.
        chunked = http.post(
            "/v1/files",
            content=(body[i : i + 512] for i in range(0, len(body), 512)),
            headers={"content-type": ctype},
        )
        # A declared length far over the limit is refused before the body is read.
        declared = http.post(
            "/v1/files",
            content=b"z" * (200 * 1024),
            headers={"content-type": ctype},
        )
    for response in (chunked, declared):
        assert response.status_code == 413, response.text
        assert str(LIMIT) in response.json()["error"]["message"]

    assert _stored_files(server.storage_url) == [str(Path(server.storage_url, "files", exactly.id))]
    assert [f.id for f in client.files.list()][:1] == [exactly.id]


def test_list_pagination(client):
    ids = [client.files.create(file=(f"{i}.jsonl", LINES), purpose="batch").id for i in range(3)]
    newest_first = list(reversed(ids))

    page = client.files.list(limit=2, order="desc")
    assert [f.id for f in page.data] == newest_first[:2]
    assert page.has_more is True
    nxt = client.files.list(limit=2, order="desc", after=page.data[-1].id)
    assert nxt.data[0].id == newest_first[2]

    listing = client.with_raw_response.files.list(limit=2).http_response.json()
    assert listing["object"] == "list"
    assert listing["first_id"] == newest_first[0]
    assert listing["last_id"] == newest_first[1]

    ascending = [f.id for f in client.files.list(order="asc", limit=10_000)]
    assert ascending[-3:] == ids

    walked = [f.id for f in client.files.list(limit=1)]  # auto-pagination, one per page
    assert walked[:3] == newest_first

    with pytest.raises(openai.BadRequestError) as caught:
        client.files.list(limit=0)
    assert caught.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.list(after="file-missing")
    assert caught.value.body["param"] == "after"
