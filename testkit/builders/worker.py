"""Batches and rows for the tests that drive the worker in-process or read its database
(request lines come from :mod:`testkit.builders.lines`)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import pytest

from testkit.builders.lines import MODEL, chat_line, completion_line, jsonl

__all__ = [
    "MODEL",
    "batch_row",
    "chat_line",
    "completion_line",
    "enqueued_batch",
    "make_batch",
    "read_file_lines",
    "shard_rows",
    "use_service_env",
    "validated_batch",
]


def make_batch(
    lines: list[dict[str, Any]] | bytes,
    *,
    endpoint: str = "/v1/chat/completions",
    expires_in_s: float = 3600,
) -> str:
    """Store an input file and create its batch in ``validating``; return the batch id."""
    from core.batches import ids
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File
    from worker.infra.task_io import storage

    data = lines if isinstance(lines, bytes) else jsonl(lines)
    file_id = ids.file_id()
    with storage().writer(f"files/{file_id}") as out:
        out.write(data)
    batch_id = ids.batch_id()
    with session_scope() as session:
        session.add(
            File(
                id=file_id,
                purpose="batch",
                filename="in.jsonl",
                bytes=len(data),
                storage_key=f"files/{file_id}",
            )
        )
        session.flush()
        session.add(
            Batch(
                id=batch_id,
                endpoint=endpoint,
                input_file_id=file_id,
                completion_window="24h",
                status="validating",
                expires_at=now() + timedelta(seconds=expires_in_s),
            )
        )
    return batch_id


def read_file_lines(file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    from core.database.sessions import session_scope
    from core.database.tables import File
    from worker.infra.task_io import storage

    with session_scope() as session:
        key = session.get(File, file_id).storage_key
    with storage().reader(key) as stream:
        return [json.loads(line) for line in stream.read().splitlines() if line.strip()]


def batch_row(batch_id: str) -> Any:
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        session.expunge(batch)
        return batch


def shard_rows(batch_id: str) -> list[Any]:
    from sqlalchemy import select

    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        rows = list(
            session.scalars(select(Shard).where(Shard.batch_id == batch_id).order_by(Shard.index))
        )
        session.expunge_all()
        return rows


def validated_batch(lines: list[dict[str, Any]], shard_max_requests: int | None = None) -> str:
    """A batch made of ``lines``, validated (``in_progress``, shards planned), optionally with
    at most ``shard_max_requests`` requests per shard."""
    from core.settings import get_settings
    from worker.batches.tasks import validate

    if shard_max_requests is not None:
        os.environ["BATCHD_SHARD_MAX_REQUESTS"] = str(shard_max_requests)
        get_settings.cache_clear()
    try:
        batch_id = make_batch(lines)
        assert validate(batch_id) == "in_progress"
    finally:
        if shard_max_requests is not None:
            del os.environ["BATCHD_SHARD_MAX_REQUESTS"]
            get_settings.cache_clear()
    return batch_id


def use_service_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process's settings (database, storage) at the service under test."""
    from core.settings import get_settings

    for key in ("BATCHD_DATABASE_URL", "BATCHD_STORAGE_URL", "BATCHD_BROKER_URL", "BATCHD_HOME"):
        monkeypatch.setenv(key, env[key])
    get_settings.cache_clear()


def enqueued_batch(lines: list[dict[str, Any]], broker: str) -> str:
    """Store the input, insert its file and batch rows (``validating``), and enqueue the
    validate task on ``broker``, as the API would for a service run as subprocesses."""
    from core.batches import ids
    from core.broker.queue import TASK_VALIDATE, enqueue
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import Batch, File
    from worker.infra.task_io import storage

    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    file_id, batch_id = ids.file_id(), ids.batch_id()
    with storage().writer(f"files/{file_id}") as out:
        out.write(data)
    with session_scope() as session:
        session.add(
            File(id=file_id, purpose="batch", filename="in.jsonl", bytes=len(data),
                 storage_key=f"files/{file_id}")
        )  # fmt: skip
        session.flush()
        session.add(
            Batch(id=batch_id, endpoint="/v1/chat/completions", input_file_id=file_id,
                  completion_window="24h", status="validating",
                  expires_at=now() + timedelta(hours=1))
        )  # fmt: skip
    enqueue(TASK_VALIDATE, batch_id, broker_url=broker)
    return batch_id
