"""A slow upload holds no database connection: the key is checked, the connection goes back to
the pool, then the body is read at the client's pace. Twenty trickling uploads used to hold
twenty connections idle in a transaction and empty the API's pool for every tenant."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.api.conftest import Server

pytestmark = pytest.mark.services


def _held_in_transaction(pg_url: str) -> int:
    from sqlalchemy import create_engine, text

    database = urlsplit(pg_url.replace("+psycopg", "")).path.lstrip("/")
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = :db "
                        "AND state = 'idle in transaction' AND pid <> pg_backend_pid()"
                    ),
                    {"db": database},
                ).scalar()
            )
    finally:
        engine.dispose()


def _start_upload(server: Server, path: str, fields: bytes) -> socket.socket:
    """Headers and the start of a multipart body promising much more."""
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    sock = socket.create_connection((host, port))
    boundary = b"slowslowslow"
    head = (
        b"--" + boundary + b"\r\n" + fields + b"--" + boundary + b"\r\n"
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n"
    )
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {server.api_key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary.decode()}\r\n"
        f"Content-Length: {len(head) + 10_000_000}\r\n\r\n".encode()
        + head
        + b'{"custom_id": "a"'
    )
    return sock


def test_a_slow_upload_holds_no_database_connection(server: Server, pg_url: str) -> None:
    purpose = b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    # The key's use is recorded (a write, committed) once a minute: after this call the
    # uploads' checks only read, which is what left their transactions open.
    server.client().files.list()
    uploads = [_start_upload(server, "/v1/files", purpose) for _ in range(3)]
    try:
        time.sleep(1.0)  # the key checked, the body under way
        deadline = time.monotonic() + 10
        held = _held_in_transaction(pg_url)
        while held and time.monotonic() < deadline:  # a check still finishing
            time.sleep(0.2)
            held = _held_in_transaction(pg_url)
        assert held == 0
        # ... and the API still answers everyone at once.
        listed = server.client().files.list()
        assert listed is not None
    finally:
        for sock in uploads:
            sock.close()
