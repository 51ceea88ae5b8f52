"""The retry endpoint's service against hostile parent inputs, on real Postgres, Redis and
storage: lines it cannot read are passed over (never a 500), and a retry that is refused leaves
no copy of the parent's lines behind."""

from __future__ import annotations

import json

import pytest

from tests.helpers.worker import chat_line, make_batch

pytestmark = pytest.mark.services

NESTED = '{"custom_id": "r1", "body": ' + "[" * 5000 + "]" * 5000 + "}"


def _ended_parent(lines: list) -> str:
    """A batch that expired with ``r1`` and ``r2`` never run (its error file says so)."""
    from sqlalchemy import update

    from core import ids
    from core.db import session_scope
    from core.models import Batch, File
    from core.results import batch_error_line, dumps_line
    from worker.common import storage

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


def _retry(batch_id: str, **body):
    from api.deps import Caller
    from api.schemas import RetryCreate
    from api.services.retries import retry_batch
    from core.db import session_scope
    from core.settings import get_settings
    from worker.common import storage

    with session_scope() as session:
        retry = retry_batch(session, storage(), Caller(), get_settings(), batch_id,
                            RetryCreate(**body))  # fmt: skip
        return retry.input_file_id


def _files() -> int:
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import File

    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(File))


def test_unreadable_parent_lines_are_passed_over(service_env: dict[str, str]) -> None:
    from tests.helpers.worker import read_file_lines

    parent = _ended_parent([
        chat_line("r0", "fine"),
        '{"custom_id": ["r1"], "method": "POST"}',  # a custom_id that is a list
        NESTED,  # nested past the parser's depth
        chat_line("r2", "fine too"),
    ])  # fmt: skip
    copy = _retry(parent)
    assert [line["custom_id"] for line in read_file_lines(copy)] == ["r2"]


def test_a_refused_retry_leaves_no_copy(service_env: dict[str, str]) -> None:
    from api.errors import APIError

    parent = _ended_parent([chat_line("r1", "one"), chat_line("r2", "two")])
    before = _files()
    with pytest.raises(APIError) as refused:
        _retry(parent, priority="high")  # above the caller's entitlement
    assert refused.value.status_code == 403
    assert _files() == before


def test_the_copy_is_read_with_the_line_bound(service_env: dict[str, str], monkeypatch) -> None:
    from core.settings import get_settings
    from tests.helpers.worker import read_file_lines

    long_line = json.dumps(chat_line("r1", "x" * 5000))
    parent = _ended_parent([long_line, chat_line("r2", "short")])
    monkeypatch.setenv("BATCHD_MAX_LINE_BYTES", "2000")
    get_settings.cache_clear()
    copy = _retry(parent)
    assert [line["custom_id"] for line in read_file_lines(copy)] == ["r2"]
