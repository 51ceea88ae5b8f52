"""The Uploads API's bookkeeping against a real server on Postgres: an upload's parts never
hold more than its declared ``bytes`` nor more than ``max_upload_parts`` parts (concurrent
parts included), its size is bounded by ``max_chunked_upload_bytes``, no part is recorded
once the upload stopped being pending, a complete that died is recovered, and bad names and
media types are 400s naming the field."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text

from tests.api.conftest import Server

pytestmark = pytest.mark.services

#: Concurrent part uploads, each its own request (the per-tenant cap must not refuse them).
JSON = "application/json"
MANY = {"BATCHD_MAX_CONCURRENT_UPLOADS": "64", "BATCHD_MAX_CONCURRENT_UPLOADS_PER_TENANT": "64"}


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


def _create(http: httpx.Client, size: int, **fields: Any) -> dict[str, Any]:
    body = {"filename": "in.jsonl", "purpose": "batch", "bytes": size,
            "mime_type": "application/jsonl", **fields}  # fmt: skip
    response = http.post("/v1/uploads", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _add(http: httpx.Client, upload: str, data: bytes) -> httpx.Response:
    return http.post(f"/v1/uploads/{upload}/parts", files={"data": ("blob", data)})


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def _stored(server: Server, upload: str) -> list[Path]:
    root = Path(server.storage_url) / "uploads" / upload
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _upload_row(db: Engine, upload: str) -> dict[str, Any]:
    with db.connect() as conn:
        row = conn.execute(text("SELECT * FROM uploads WHERE id = :id"), {"id": upload}).one()
        parts = conn.scalar(
            text("SELECT count(*) FROM upload_parts WHERE upload_id = :id"), {"id": upload}
        )
    return {**row._mapping, "part_rows": parts}


# Bounds.


def test_parts_never_hold_more_than_the_declared_bytes(server: Server, db: Engine) -> None:
    with server.http() as http:
        upload = _create(http, 10)["id"]
        assert _add(http, upload, b"123456").status_code == 200
        error = _error(_add(http, upload, b"78901"))  # 6 + 5 > 10
        assert error["param"] == "data" and error["code"] == "upload_bytes_exceeded"
        assert "10 bytes it was created for" in error["message"]
        assert "hold 6 bytes so far" in error["message"]
        assert _add(http, upload, b"7890").status_code == 200  # exactly the 10 declared
        error = _error(_add(http, upload, b"x"))
        assert "hold 10 bytes so far" in error["message"]

        # A part far larger than the room left is cut off as it arrives: a 400 all the same.
        small = _create(http, 1)["id"]
        error = _error(_add(http, small, b"y" * (1024 * 1024)))
        assert (
            error["code"] == "upload_bytes_exceeded"
            and "1 bytes it was created for" in (error["message"])
        )
        assert _stored(server, small) == []
    row = _upload_row(db, upload)
    assert (row["part_count"], row["received_bytes"], row["part_rows"]) == (2, 10, 2)
    assert len(_stored(server, upload)) == 2  # the refused parts left nothing stored


def test_an_upload_holds_at_most_max_upload_parts_parts(start_server, db: Engine) -> None:
    server = start_server(BATCHD_MAX_UPLOAD_PARTS="3")
    with server.http() as http:
        upload = _create(http, 10)["id"]
        for _ in range(3):
            assert _add(http, upload, b"a").status_code == 200
        error = _error(_add(http, upload, b"b"))
        assert error["code"] == "too_many_parts" and "max_upload_parts=3" in error["message"]
    assert _upload_row(db, upload)["part_rows"] == 3
    assert len(_stored(server, upload)) == 3


def test_concurrent_parts_cannot_pass_the_declared_bytes_together(start_server, db: Engine) -> None:
    server = start_server(**MANY)
    with server.http() as http:
        upload = _create(http, 10)["id"]
        start = threading.Barrier(24)

        def one(i: int) -> int:
            with server.http() as own:
                start.wait()
                return _add(own, upload, bytes([65 + i])).status_code

        with ThreadPoolExecutor(24) as pool:
            codes = list(pool.map(one, range(24)))
    assert sorted(codes) == [200] * 10 + [400] * 14, codes
    row = _upload_row(db, upload)
    assert (row["part_count"], row["received_bytes"], row["part_rows"]) == (10, 10, 10)
    assert len(_stored(server, upload)) == 10


def test_an_upload_is_at_most_max_chunked_upload_bytes(start_server, server: Server) -> None:
    with server.http() as http:  # the default: OpenAI's 8 GB
        error = _error(http.post("/v1/uploads", json={
            "filename": "a", "purpose": "batch", "bytes": 8 * 1024**3 + 1, "mime_type": "text/plain"
        }))  # fmt: skip
        assert error["param"] == "bytes" and str(8 * 1024**3) in error["message"]
        assert _create(http, 8 * 1024**3)["bytes"] == 8 * 1024**3
    small = start_server(BATCHD_MAX_CHUNKED_UPLOAD_BYTES="1000")
    with small.http() as http:
        for size in (1001, 10**30, 0, -1):
            body = {"filename": "a", "purpose": "batch", "bytes": size, "mime_type": "text/plain"}
            error = _error(http.post("/v1/uploads", json=body))
            assert error["param"] == "bytes", error
            if size > 0:
                assert "1000 bytes (max_chunked_upload_bytes)" in error["message"], error
        upload = _create(http, 1000)["id"]
        # A part over the limit cannot get in either: the upload has room for 1000 bytes.
        error = _error(_add(http, upload, b"z" * 1001))
        assert error["code"] == "upload_bytes_exceeded"


# Bad names and media types: 400 naming the field, never a 500 (the server fixture fails a
# test whose server logged an unhandled error).

BAD_TEXT = {
    "nul": "a\x00b",
    "newline": "a\nb",
    "carriage return": "a\rb",
    "escape": "a\x1b[31mb",
    "delete": "a\x7fb",
    "C1 control": "a\x85b",
    "line separator": "a\u2028b",
    "lone surrogate": "a\ud800b",
}


@pytest.mark.parametrize("field", ["filename", "mime_type"])
def test_bad_characters_are_a_400_naming_the_field(server: Server, field: str) -> None:
    with server.http() as http:
        for name, value in BAD_TEXT.items():
            body = {"filename": "in.jsonl", "purpose": "batch", "bytes": 5,
                    "mime_type": "application/jsonl", field: value}  # fmt: skip
            # JSON with \u escapes, as a client's encoder writes a lone surrogate.
            response = http.post(
                "/v1/uploads", content=json.dumps(body), headers={"content-type": JSON}
            )
            error = _error(response)
            assert error["param"] == field, (name, error)
        too_long = {"filename": "n" * 1025, "mime_type": "m/" + "t" * 127}[field]
        body = {"filename": "in.jsonl", "purpose": "batch", "bytes": 5,
                "mime_type": "application/jsonl", field: too_long}  # fmt: skip
        assert _error(http.post("/v1/uploads", json=body))["param"] == field
        body[field] = ""
        assert _error(http.post("/v1/uploads", json=body))["param"] == field
        body[field] = "  " if field == "filename" else "text/plain; charset=\u00e9"
        assert _error(http.post("/v1/uploads", json=body))["param"] == field
        # Raw bytes that are not UTF-8 at all: the body is not JSON.
        raw = b'{"filename": "a\xff", "purpose": "batch", "bytes": 5, "mime_type": "text/plain"}'
        response = http.post("/v1/uploads", content=raw, headers={"content-type": JSON})
        assert response.status_code == 400, response.text
        # What stays accepted: a path (its last component is kept), non-ASCII, parameters.
        fine = _create(http, 5, filename="dir/données é.jsonl", mime_type="text/plain; q=1")
        assert fine["filename"] == "données é.jsonl"


# No part after the upload stopped being pending.


def test_a_part_after_complete_is_refused_and_leaves_nothing(server: Server, db: Engine) -> None:
    with server.http() as http:
        upload = _create(http, 4)["id"]
        part = _add(http, upload, b"abcd").json()["id"]
        done = http.post(f"/v1/uploads/{upload}/complete", json={"part_ids": [part]})
        assert done.status_code == 200, done.text
        error = _error(_add(http, upload, b""))
        assert error["code"] == "upload_not_pending" and "completed" in error["message"]
    assert _upload_row(db, upload)["part_rows"] == 0
    assert _stored(server, upload) == []


def _lock_waiters(db: Engine) -> int:
    with db.connect() as conn:
        return conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        )


def test_a_part_recorded_as_the_upload_stops_being_pending_is_refused(
    server: Server, db: Engine
) -> None:
    """The race a cancel (or a complete, or the expiry sweep) runs against a part: the part
    passed its check while the upload was pending, and records itself while another
    transaction moves the upload on. That transaction is held open here, so the interleaving
    is the worst one every time: the part must wait for it and then be refused, its bytes
    deleted, never recorded as a part of a cancelled upload."""
    with server.http() as http:
        upload = _create(http, 10)["id"]
        assert _add(http, upload, b"12345").status_code == 200
    with db.connect() as conn:
        moving = conn.begin()
        conn.execute(text("UPDATE uploads SET status = 'cancelled' WHERE id = :id"), {"id": upload})
        answers: list[httpx.Response] = []

        def add() -> None:
            with server.http() as own:
                answers.append(_add(own, upload, b"678"))

        adding = threading.Thread(target=add)
        adding.start()
        deadline = time.monotonic() + 30
        while adding.is_alive() and _lock_waiters(db) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        moving.commit()
    adding.join(30)
    error = _error(answers[0])
    assert error["code"] == "upload_not_pending" and "cancelled" in error["message"]
    assert _upload_row(db, upload)["part_rows"] == 1  # only the part from before
    assert len(_stored(server, upload)) == 1


def test_parts_racing_a_complete_leave_no_orphan(start_server, db: Engine) -> None:
    """Empty parts still fit an upload that holds its declared bytes: they race a complete
    from many threads. Each is refused or was recorded before the complete's claim (and is
    then deleted with the parts the complete did not name): nothing outlives the upload."""
    server = start_server(**MANY)
    for _ in range(3):
        with server.http() as http:
            upload = _create(http, 6)["id"]
            part = _add(http, upload, b"abcdef").json()["id"]
        codes = _race_a_complete(server, upload, part, adders=16)
        assert codes[0] == 200 and set(codes[1:]) <= {200, 400}, codes
        row = _upload_row(db, upload)
        assert row["status"] == "completed" and row["part_rows"] == 0
        assert _stored(server, upload) == []


def _race_a_complete(server: Server, upload: str, part: str, adders: int) -> list[int]:
    """Complete ``upload`` (naming ``part``) while ``adders`` threads add empty parts, all
    released at once; the status codes, the complete's first."""
    start = threading.Barrier(adders + 1)

    def one(i: int) -> int:
        with server.http() as own:
            start.wait()
            if i == 0:
                url = f"/v1/uploads/{upload}/complete"
                return own.post(url, json={"part_ids": [part]}).status_code
            return _add(own, upload, b"").status_code

    with ThreadPoolExecutor(adders + 1) as pool:
        return list(pool.map(one, range(adders + 1)))


# A complete that died.


def _stick(db: Engine, upload: str, file_id: str, age_s: float) -> None:
    """Leave ``upload`` as a complete that died leaves it: claimed ``age_s`` ago."""
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE uploads SET status = 'completing', file_id = :f, "
                "completing_since = now() - make_interval(secs => :age) WHERE id = :id"
            ),
            {"f": file_id, "age": age_s, "id": upload},
        )


def test_a_complete_that_died_is_recovered_by_a_retry(server: Server, db: Engine) -> None:
    data = b'{"a": 1}\n{"b": 2}\n'
    with server.http() as http:
        upload = _create(http, len(data))["id"]
        parts = [
            _add(http, upload, data[:9]).json()["id"],
            _add(http, upload, data[9:]).json()["id"],
        ]
        # The dead complete wrote half of its file.
        half = Path(server.storage_url) / "files" / "file-dead"
        half.parent.mkdir(parents=True, exist_ok=True)
        half.write_bytes(data[:9])

        _stick(db, upload, "file-dead", age_s=5)  # a complete still within its lease
        error = _error(http.post(f"/v1/uploads/{upload}/complete", json={"part_ids": parts}), 409)
        assert "upload_complete_lease_s" in error["message"]
        assert _error(http.post(f"/v1/uploads/{upload}/cancel"), 409)
        assert half.exists()
        assert http.get("/v1/files/file-dead").status_code == 404  # never a file

        _stick(db, upload, "file-dead", age_s=301)  # past the 300 s lease: it died
        done = http.post(f"/v1/uploads/{upload}/complete", json={"part_ids": parts})
        assert done.status_code == 200, done.text
        file = done.json()["file"]
        assert done.json()["status"] == "completed" and file["id"] != "file-dead"
        assert http.get(f"/v1/files/{file['id']}/content").content == data
        assert not half.exists()  # what the dead complete wrote is gone
        assert http.get("/v1/files/file-dead").status_code == 404
    row = _upload_row(db, upload)
    assert (row["status"], row["file_id"], row["completing_since"]) == (
        "completed",
        file["id"],
        None,
    )
    assert _stored(server, upload) == []


def test_a_cancel_takes_back_an_upload_whose_complete_died(server: Server, db: Engine) -> None:
    with server.http() as http:
        upload = _create(http, 3)["id"]
        _add(http, upload, b"abc")
        _stick(db, upload, "file-gone", age_s=3600)
        cancelled = http.post(f"/v1/uploads/{upload}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert _upload_row(db, upload)["part_rows"] == 0
    assert _stored(server, upload) == []


def test_a_complete_that_lost_its_claim_writes_no_file(service_env, db: Engine) -> None:
    """A complete that is slow, not dead: its claim is given back (as the sweep does once the
    lease passed) while it joins the parts. Its next renewal finds the claim gone; it stops,
    deletes what it wrote, records no file, and the upload is pending for the next complete."""
    from api.errors import APIError
    from api.services import uploads
    from core.database import uploads as upload_states
    from core.database.sessions import session_scope
    from core.database.tables import File
    from core.settings import get_settings
    from core.storage.local import LocalStorage

    settings = get_settings().model_copy(update={"upload_complete_lease_s": 0.001})
    storage = LocalStorage(service_env["BATCHD_STORAGE_URL"])

    class Caller:
        tenant = "t-slow"

    with session_scope() as session:
        row = uploads.create(
            session, Caller(), settings, filename="a", purpose="batch", size=4, mime_type="a/b"
        )
        upload = row.id
        names = []
        for data in (b"ab", b"cd"):
            part = f"part_{data.decode()}"
            key = uploads.part_key(upload, part)
            with storage.writer(key) as out:
                out.write(data)
            uploads.add_part(session, "t-slow", upload, part, key, len(data), 10)
            names.append(part)

    class TakenOver(LocalStorage):
        """The sweep gives the claim back while the first part is read."""

        def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
            if key.endswith("part_ab"):
                time.sleep(0.01)
                with session_scope() as other:
                    assert upload_states.release_stale_claim(other, storage, upload, 0.001)
            yield from super().iter_chunks(key, chunk_size)

    with session_scope() as session, pytest.raises(APIError) as caught:
        uploads.complete(
            session, TakenOver(service_env["BATCHD_STORAGE_URL"]), "t-slow", upload, names,
            None, settings,
        )  # fmt: skip
    assert caught.value.status_code == 409 and caught.value.code == "upload_claim_lost"
    row = _upload_row(db, upload)
    assert (row["status"], row["file_id"], row["part_rows"]) == ("pending", None, 2)
    assert storage.list("files/") == []
    with session_scope() as session:
        assert session.query(File).filter(File.tenant == "t-slow").count() == 0
        _row, file = uploads.complete(session, storage, "t-slow", upload, names, None, settings)
    with storage.reader(file.storage_key) as stream:
        assert stream.read() == b"abcd"
