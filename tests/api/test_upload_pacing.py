"""Slow and greedy upload bodies against a real server, through raw sockets on loopback: a body
that stalls or trickles is cut with a 408 and frees its slot and its partial file; one tenant
holds at most its share of the upload slots; the form fields beside the file are bounded."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.api.conftest import Server

pytestmark = pytest.mark.services

BOUNDARY = b"PaCeBoUnDaRy"
CTYPE = f"multipart/form-data; boundary={BOUNDARY.decode()}"
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def _part(disposition: bytes, data: bytes) -> bytes:
    return (
        b"--" + BOUNDARY + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + data + b"\r\n"
    )


def _body(fields: list[tuple[bytes, bytes]], file_data: bytes) -> bytes:
    body = b"".join(_part(b'form-data; name="' + name + b'"', value) for name, value in fields)
    body += _part(b'form-data; name="file"; filename="a.jsonl"', file_data)
    return body + b"--" + BOUNDARY + b"--\r\n"


def _stored(server: Server) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(server.storage_url):
        found += [str(Path(root, name)) for name in names]
    return sorted(found)


class RawUpload:
    """A POST /v1/files written by hand on a socket: the head and as much of the body as the
    test sends; the rest never comes (or comes slowly)."""

    def __init__(self, server: Server, api_key: str, declared: int, path: str = "/v1/files"):
        host, port = server.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: {CTYPE}\r\nContent-Length: {declared}\r\n\r\n"
        )
        self.sock.sendall(head.encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answered(self, wait_s: float) -> bool:
        return bool(select.select([self.sock], [], [], wait_s)[0])

    def response(self) -> tuple[int, dict[str, str], dict]:
        """The status, headers and JSON body of the server's answer (read to the socket's end
        or the body's length)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            assert chunk, f"the connection closed without an answer: {data!r}"
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        length = int(headers["content-length"])
        while len(body) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "the connection closed mid-answer"
            body += chunk
        return status, headers, json.loads(body[:length])

    def close(self) -> None:
        self.sock.close()


def test_a_stalled_upload_is_cut_with_408_and_its_slot_freed(start_server, api_key) -> None:
    # One upload slot in the process: the upload that waits for it runs only once the stalled
    # one has been cut.
    server = start_server(
        BATCHD_MAX_CONCURRENT_UPLOADS="1",
        BATCHD_UPLOAD_IDLE_TIMEOUT_S="3",
        BATCHD_UPLOAD_MIN_BYTES_PER_S="0",
    )
    with server.http() as http:  # a first upload warms the server up (imports, connections)
        warm = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                         headers={"content-type": CTYPE})  # fmt: skip
    assert warm.status_code == 200, warm.text
    kept = _stored(server)
    full = _body([(b"purpose", b"batch")], LINE * 1000)
    stalled = RawUpload(server, api_key, len(full))
    stalled.send(full[:2000])  # the purpose, the file part's head and some of its bytes
    time.sleep(1.0)  # the stalled upload holds the slot

    waiting: dict = {}

    def upload() -> None:
        with server.http() as http:
            response = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                                 headers={"content-type": CTYPE})  # fmt: skip
        waiting["response"] = response

    other = threading.Thread(target=upload)
    other.start()
    try:
        time.sleep(0.5)
        assert "response" not in waiting  # it waits for the slot the stalled one holds
        status, headers, error = stalled.response()
    finally:
        stalled.close()
        other.join(20)
    assert status == 408, error
    assert headers.get("connection") == "close"
    assert error["error"]["code"] == "upload_idle_timeout"
    assert error["error"]["type"] == "invalid_request_error"
    assert "upload_idle_timeout_s" in error["error"]["message"]
    assert "3 seconds" in error["error"]["message"]

    response = waiting["response"]
    assert response.status_code == 200, response.text
    # The stalled upload's partial file is gone; only the one that finished is stored.
    assert _stored(server) == sorted(
        [*kept, str(Path(server.storage_url, "files", response.json()["id"]))]
    )


def test_a_trickling_upload_is_cut_by_the_minimum_rate(start_server, api_key) -> None:
    server = start_server(
        BATCHD_UPLOAD_IDLE_TIMEOUT_S="30",
        BATCHD_UPLOAD_MIN_BYTES_PER_S="2000",
        BATCHD_UPLOAD_RATE_GRACE_S="0.5",
    )
    # A body that comes at a fair pace (about 10 kB/s) for longer than the grace is kept.
    full = _body([(b"purpose", b"batch")], LINE * 100)
    steady = RawUpload(server, api_key, len(full))
    try:
        for start in range(0, len(full), 1000):
            steady.send(full[start : start + 1000])
            time.sleep(0.1)
        status, _headers, created = steady.response()
    finally:
        steady.close()
    assert status == 200, created
    assert created["bytes"] == len(LINE) * 100
    kept = _stored(server)

    full = _body([(b"purpose", b"batch")], LINE * 1000)
    trickle = RawUpload(server, api_key, len(full))
    started = time.monotonic()
    try:
        sent = 0
        while not trickle.answered(0.1):  # 20 bytes each 0.1 s: about 200 bytes/s
            assert time.monotonic() - started < 10, "the trickle was never cut"
            trickle.send(full[sent : sent + 20])
            sent += 20
        status, headers, error = trickle.response()
    finally:
        trickle.close()
    # Cut once the grace has passed, long before the idle timeout could have fired.
    assert time.monotonic() - started < 8
    assert status == 408, error
    assert error["error"]["code"] == "upload_too_slow"
    assert "upload_min_bytes_per_s" in error["error"]["message"]
    assert "2000 bytes/s" in error["error"]["message"]
    assert _stored(server) == kept  # the trickle's partial file is gone


def test_one_tenant_holds_at_most_its_share_of_the_uploads(start_server, api_key, make_key) -> None:
    server = start_server(
        BATCHD_MAX_CONCURRENT_UPLOADS_PER_TENANT="2",
        BATCHD_UPLOAD_IDLE_TIMEOUT_S="20",
        BATCHD_UPLOAD_MIN_BYTES_PER_S="0",
    )
    with server.http() as http:  # a first upload warms the server up (imports, connections)
        warm = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                         headers={"content-type": CTYPE})  # fmt: skip
    assert warm.status_code == 200, warm.text
    full = _body([(b"purpose", b"batch")], LINE * 1000)
    held = [RawUpload(server, api_key, len(full)) for _ in range(2)]
    for upload in held:
        upload.send(full[:500])
    # Let the server take both in before the tenant's next upload: one that came first would
    # take a place and the second held one would be the one refused.
    time.sleep(1.0)
    try:
        with server.http() as http:
            refused = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                                headers={"content-type": CTYPE})  # fmt: skip
            created = http.post("/v1/uploads", json={"filename": "p.jsonl", "purpose": "batch",
                                "bytes": len(LINE), "mime_type": "application/jsonl"})  # fmt: skip
            assert created.status_code == 200, created.text
            part = http.post(
                f"/v1/uploads/{created.json()['id']}/parts",
                content=b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="data"; '
                b'filename="blob"\r\n\r\n' + LINE + b"\r\n--" + BOUNDARY + b"--\r\n",
                headers={"content-type": CTYPE},
            )
        # Another tenant's upload is not held back by this tenant's.
        with server.http(api_key=make_key()) as http:
            other = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                              headers={"content-type": CTYPE})  # fmt: skip
    finally:
        for upload in held:
            upload.close()
    for response in (refused, part):
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert error["code"] == "too_many_concurrent_uploads"
        assert "max_concurrent_uploads_per_tenant=2" in error["message"]
    assert other.status_code == 200, other.text

    # Once the held uploads are gone (the client closed them), the tenant uploads again.
    deadline = time.monotonic() + 10
    while True:
        with server.http() as http:
            again = http.post("/v1/files", content=_body([(b"purpose", b"batch")], LINE),
                              headers={"content-type": CTYPE})  # fmt: skip
        if again.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert again.status_code == 200, again.text


def test_form_fields_beside_the_file_are_bounded(server: Server) -> None:
    fields = [(b"purpose", b"batch")] + [(b"extra%d" % i, b"v") for i in range(15)]
    with server.http() as http:
        sixteen = http.post("/v1/files", content=_body(fields, LINE),
                            headers={"content-type": CTYPE})  # fmt: skip
        assert sixteen.status_code == 200, sixteen.text
        kept = _stored(server)

        # Thousands of small fields: refused at the first one past the limit, not held.
        many = [(b"purpose", b"batch")] + [(b"f%d" % i, b"x" * 1000) for i in range(5000)]
        too_many = http.post("/v1/files", content=_body(many, LINE),
                             headers={"content-type": CTYPE})  # fmt: skip
        long_field = http.post(
            "/v1/files",
            content=_body([(b"purpose", b"batch"), (b"note", b"n" * 1025)], LINE),
            headers={"content-type": CTYPE},
        )
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["code"] == "too_many_form_fields"
    assert "more than 16 form fields" in error["message"]
    assert long_field.status_code == 400, long_field.text
    assert "longer than 1024 bytes" in long_field.json()["error"]["message"]
    assert long_field.json()["error"]["param"] == "note"
    assert _stored(server) == kept
