"""The retry endpoint against hostile parent inputs, on real Postgres, Redis and storage: lines
it cannot read are passed over or refused by name (never a 500), a line over the line bound is
refused naming it and the bound, a retry that is refused is refused before anything is copied,
lines are picked by number, and an Idempotency-Key makes a retry once."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest

from testkit.builders.worker import chat_line, make_batch

pytestmark = pytest.mark.services

NESTED = '{"custom_id": "r1", "body": ' + "[" * 5000 + "]" * 5000 + "}"


def _ended_parent(lines: list) -> str:
    """A batch that expired with ``r1`` and ``r2`` never run (its error file says so)."""
    from sqlalchemy import update

    from core.batches import ids
    from core.batchfile.results import batch_error_line, dumps_line
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File
    from worker.infra.task_io import storage

    batch_id = make_batch(lines)
    error_id = ids.file_id()
    data = b"".join(dumps_line(batch_error_line(c, "batch_expired")) for c in ("r1", "r2"))
    with storage().writer(f"files/{error_id}") as out:
        out.write(data)
    with session_scope() as session:
        session.add(File(id=error_id, purpose="batch_output", filename="err.jsonl",
                         bytes=len(data), storage_key=f"files/{error_id}"))  # fmt: skip
        session.flush()
        session.execute(update(Batch).where(Batch.id == batch_id)
                        .values(status="expired", error_file_id=error_id))  # fmt: skip
    return batch_id


class RecordingStorage:
    """The service's real storage, noting each object it starts to write."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.written: list[str] = []

    def writer(self, key: str):
        self.written.append(key)
        return self.inner.writer(key)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _retry(batch_id: str, store=None, **body):
    from api.deps import Caller
    from api.schemas import RetryCreate
    from api.services.retries import retry_batch
    from core.database.sessions import session_scope
    from core.settings import get_settings
    from worker.infra.task_io import storage

    with session_scope() as session:
        retry = retry_batch(session, store or storage(), Caller(), get_settings(), batch_id,
                            RetryCreate(**body))  # fmt: skip
        return retry.input_file_id


def _stored(service_env: dict[str, str]) -> list[str]:
    root = Path(service_env["BATCHD_STORAGE_URL"])
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def _refused(batch_id: str, **body):
    """The APIError a retry is refused with; it wrote nothing (no file row, no object)."""
    from api.errors import APIError
    from worker.infra.task_io import storage

    before = _files()
    store = RecordingStorage(storage())
    with pytest.raises(APIError) as refused:
        _retry(batch_id, store, **body)
    assert _files() == before
    assert not any(store.inner.exists(key) for key in store.written)
    return refused.value, store


def _files() -> int:
    from sqlalchemy import func, select

    from core.database.sessions import session_scope
    from core.database.tables import File

    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(File))


def test_unreadable_parent_lines_are_passed_over(service_env: dict[str, str]) -> None:
    from testkit.builders.worker import read_file_lines

    parent = _ended_parent([
        chat_line("r0", "fine"),
        '{"custom_id": ["r1"], "method": "POST"}',  # a custom_id that is a list
        NESTED,  # nested past the parser's depth
        chat_line("r2", "fine too"),
    ])  # fmt: skip
    copy = _retry(parent)
    assert [line["custom_id"] for line in read_file_lines(copy)] == ["r2"]


def test_a_refused_retry_copies_nothing(service_env: dict[str, str], monkeypatch) -> None:
    from core.settings import get_settings

    parent = _ended_parent([chat_line("r1", "one"), chat_line("r2", "two")])
    stored = _stored(service_env)
    # Above the caller's entitlement: refused before the parent's lines are read.
    refused, store = _refused(parent, priority="high")
    assert refused.status_code == 403
    assert store.written == []

    # The tenant's quota of unfinished batches is full: refused before copying, too.
    make_batch([chat_line("x", "unfinished")])
    monkeypatch.setenv("BATCHD_MAX_UNFINISHED_BATCHES_PER_TENANT", "1")
    get_settings.cache_clear()
    stored = _stored(service_env)
    refused, store = _refused(parent)
    assert refused.status_code == 429
    assert "max_unfinished_batches_per_tenant" in refused.message
    assert store.written == []
    assert _stored(service_env) == stored


def test_a_line_over_the_bound_is_refused_by_name(service_env: dict[str, str], monkeypatch) -> None:
    from core.settings import get_settings
    from testkit.builders.worker import read_file_lines

    long_wanted = _ended_parent([json.dumps(chat_line("r1", "x" * 5000)), chat_line("r2", "2")])
    long_done = _ended_parent([json.dumps(chat_line("r0", "x" * 5000)), chat_line("r1", "1"),
                               chat_line("r2", "2")])  # fmt: skip
    monkeypatch.setenv("BATCHD_MAX_LINE_BYTES", "2000")
    get_settings.cache_clear()
    stored = _stored(service_env)
    refused, _store = _refused(long_wanted)
    assert refused.status_code == 400
    assert refused.code == "line_too_long"
    assert refused.message.startswith("Line 1 of the input file")
    assert "longer than 2000 bytes" in refused.message and "max_line_bytes" in refused.message
    assert _stored(service_env) == stored
    # A long line that is not to be retried (r0 succeeded) stands in no one's way.
    copy = _retry(long_done)
    assert [line["custom_id"] for line in read_file_lines(copy)] == ["r1", "r2"]


def test_lines_are_picked_by_number(service_env: dict[str, str]) -> None:
    from testkit.builders.worker import read_file_lines

    parent = _ended_parent([
        chat_line("r0", "done"),                       # 1: succeeded, not to retry
        "",                                            # 2: blank
        chat_line("r1", "one"),                        # 3
        '{"custom_id": ["r9"], "method": "POST"}',     # 4: a custom_id that is a list
        NESTED,                                        # 5: nested past the parser's depth
        chat_line("r2", "two"),                        # 6
    ])  # fmt: skip

    def ids(**body) -> list[str]:
        return [line["custom_id"] for line in read_file_lines(_retry(parent, **body))]

    assert ids(lines=[3]) == ["r1"]
    assert ids(lines=[6]) == ["r2"]
    assert ids(lines=[[1, 6]]) == ["r1", "r2"]  # in a range, lines without a result pass
    assert ids(lines=[[5, 6], 3, [3, 3]]) == ["r1", "r2"]
    assert ids(lines=[[2, 4]], include=["expired"]) == ["r1"]

    refused, _ = _refused(parent, lines=[7, 3, [5, 9]])
    assert (refused.status_code, refused.param, refused.code) == (
        400,
        "lines",
        "lines_out_of_range",
    )
    assert "'lines': 7, 5-9 are past the end" in refused.message
    assert "last line is 6" in refused.message
    refused, _ = _refused(parent, lines=[2])
    assert refused.code == "line_blank" and "line 2 " in refused.message
    assert "blank" in refused.message
    for number in (4, 5):  # asked for by number, a line no retry can read is named
        refused, _ = _refused(parent, lines=[number])
        assert (refused.status_code, refused.code) == (400, "line_unreadable")
        assert refused.message.startswith(f"Line {number} of the input file")
    refused, _ = _refused(parent, lines=[1])
    assert refused.code == "nothing_to_retry"
    assert "None of the lines 1 of batch" in refused.message
    refused, _ = _refused(parent, lines=[3], include=["failed"])
    assert refused.code == "nothing_to_retry"


def test_an_idempotency_key_makes_one_retry(start_server, pg_url) -> None:
    from tests.conftest import STATIC_TEST_KEY

    server = start_server()
    # The static key's tenant is shared with other modules' tests: keys of this test's own.
    run = secrets.token_hex(4)
    parent = _ended_parent([chat_line("r1", "one"), chat_line("r2", "two")])
    other = _ended_parent([chat_line("r1", "one"), chat_line("r2", "two")])
    with server.http(api_key=STATIC_TEST_KEY) as http:

        def retry(batch_id: str, key: str | None, body: dict | None = None) -> httpx.Response:
            headers = {"Idempotency-Key": key} if key else {}
            return http.post(f"/v1/batches/{batch_id}/retry", json=body, headers=headers)

        first = retry(parent, f"k-1-{run}", {"include": ["expired"]})
        assert first.status_code == 200, first.text
        files = _files()
        again = retry(parent, f"k-1-{run}", {"include": ["expired"]})
        assert again.status_code == 200, again.text
        assert again.json()["id"] == first.json()["id"]
        assert again.json()["input_file_id"] == first.json()["input_file_id"]
        assert _files() == files  # nothing copied for the repeat

        for body, batch_id, differs in [
            ({"include": ["failed"]}, parent, "include"),
            ({"include": ["expired"], "lines": [1]}, parent, "lines"),
            ({"include": ["expired"], "completion_window": "1h"}, parent, "completion_window"),
            ({"include": ["expired"]}, other, "parent batch"),
        ]:
            conflict = retry(batch_id, f"k-1-{run}", body)
            assert conflict.status_code == 409, conflict.text
            error = conflict.json()["error"]
            assert error["code"] == "idempotency_key_reused"
            assert f"with another {differs}" in error["message"]

        # The same lines, spelled another way, are the same retry.
        ranged = retry(other, f"k-3-{run}", {"lines": [[1, 2]]})
        assert ranged.status_code == 200, ranged.text
        assert retry(other, f"k-3-{run}", {"lines": [2, 1]}).json()["id"] == ranged.json()["id"]

        # A key a plain create used is not a retry's.
        created = http.post(
            "/v1/batches",
            json={"input_file_id": first.json()["input_file_id"],
                  "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            headers={"Idempotency-Key": f"k-2-{run}"},
        )  # fmt: skip
        assert created.status_code == 200, created.text
        conflict = retry(parent, f"k-2-{run}")
        assert conflict.status_code == 409, conflict.text
        assert "it was not a retry" in conflict.json()["error"]["message"]

        # Without a key each retry is a new batch; the body's lines are checked.
        assert retry(parent, None).json()["id"] != first.json()["id"]
        for lines, param, words in [
            ([[5, 2]], "lines", "the range [5, 2] ends before it starts"),
            (["3"], "lines.0", "expected a line number"),
            ([[1, 2, 3]], "lines.0", "or a range [first, last]"),
            ([0], "lines.0", "1 or more"),
        ]:
            bad = retry(parent, None, {"lines": lines})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] == param
            assert words in bad.json()["error"]["message"]


def test_concurrent_retries_with_one_key_make_one_batch(start_server, service_env) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import STATIC_TEST_KEY

    server = start_server()
    parent = _ended_parent([chat_line("r1", "one"), chat_line("r2", "two")])
    files, stored = _files(), _stored(service_env)

    def retry(_i: int) -> httpx.Response:
        with server.http(api_key=STATIC_TEST_KEY) as http:
            return http.post(f"/v1/batches/{parent}/retry", headers={"Idempotency-Key": "race"})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(retry, range(8)))
    assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    # One copy of the parent's lines is kept: the losers' copies are gone, rows and objects.
    assert _files() == files + 1
    assert len(_stored(service_env)) == len(stored) + 1
