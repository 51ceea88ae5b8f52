"""File retention end to end: the beat sweep deletes expired files (row and stored object),
never the input of a batch that is still running, and batch output files get an expiry."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest

from testkit.builders.lines import chat_line, jsonl

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module", autouse=True)
def _fast_sweep() -> Iterator[None]:
    """The file sweep every second in the stack this module starts."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHD_FILE_SWEEP_INTERVAL_S", "1")
        yield


def _sql(stack, query: str, **params: Any) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine, text

    engine = create_engine(stack.env["BATCHD_DATABASE_URL"])
    try:
        with engine.begin() as conn:
            result = conn.execute(text(query), params)
            return [dict(r._mapping) for r in result] if result.returns_rows else []
    finally:
        engine.dispose()


def _file(stack, file_id: str) -> dict[str, Any] | None:
    rows = _sql(stack, "SELECT * FROM files WHERE id = :id", id=file_id)
    return rows[0] if rows else None


def _object(stack, row: dict[str, Any]) -> Path:
    return Path(stack.env["BATCHD_STORAGE_URL"]) / row["storage_key"]


def _expire_now(stack, file_id: str) -> None:
    _sql(
        stack,
        "UPDATE files SET expires_at = now() - interval '1 second' WHERE id = :id",
        id=file_id,
    )


def _upload(stack, lines: list[dict[str, Any]]) -> str:
    data = jsonl(lines)
    return stack.client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _chat(custom_id: str, max_tokens: int) -> dict[str, Any]:
    return chat_line(custom_id, f"write about the sea {custom_id}", max_tokens, ignore_eos=True)


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_expired_unused_upload_is_deleted(stack):
    file_id = _upload(stack, [_chat("a", 4)])
    row = _file(stack, file_id)
    assert row["expires_at"] is not None and _object(stack, row).exists()
    _expire_now(stack, file_id)
    _until(
        lambda: _file(stack, file_id) is None and not _object(stack, row).exists(),
        15,
        "the sweep to delete the file (row and stored object)",
    )
    with pytest.raises(openai.NotFoundError):
        stack.client.files.retrieve(file_id)


def test_output_expires_after_sets_the_expiry_of_output_and_error_files(stack):
    """OpenAI's ``output_expires_after``: the output and the error file expire that many
    seconds after they are created, and the sweep deletes them once they have."""
    lines = [_chat("ok-1", 4), _chat("ok-2", 4)]
    lines.append(
        {**_chat("too-long", 4), "body": {**_chat("x", 4)["body"],
         "messages": [{"role": "user", "content": "the cat " * 700}]}}
    )  # fmt: skip  # longer than the context: an error line
    batch = stack.client.batches.create(
        input_file_id=_upload(stack, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 7200}},
    )
    done = _until(
        lambda: (b := stack.client.batches.retrieve(batch.id)).status in TERMINAL and b,
        240,
        "the batch to finish",
    )
    assert done.status == "completed", done
    assert done.output_file_id and done.error_file_id
    for file_id in (done.output_file_id, done.error_file_id):
        public = stack.client.files.retrieve(file_id)
        assert public.purpose == "batch_output"
        assert public.expires_at == public.created_at + 7200, public
        assert abs(public.created_at - done.completed_at) <= 5
    # The sweep deletes the output once it has expired (moved into the past here).
    out = _file(stack, done.output_file_id)
    _expire_now(stack, done.output_file_id)
    # The sweep commits the row's deletion first, then deletes the stored object.
    _until(
        lambda: _file(stack, done.output_file_id) is None and not _object(stack, out).exists(),
        15,
        "the sweep to delete the output (row and stored object)",
    )
    with pytest.raises(openai.NotFoundError):
        stack.client.files.content(done.output_file_id)
    assert _file(stack, done.error_file_id) is not None  # not expired yet: kept


@pytest.mark.parametrize(
    ("value", "param", "message"),
    [
        ({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds",
         "Invalid 'output_expires_after.seconds': integer below minimum value. Expected a value "
         ">= 3600, but got 3599 instead."),
        ({"anchor": "created_at", "seconds": 2592001}, "output_expires_after.seconds",
         "Invalid 'output_expires_after.seconds': integer above maximum value. Expected a value "
         "<= 2592000, but got 2592001 instead."),
        ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor",
         "Invalid value: 'completed_at'. Supported values are: 'created_at'."),
        ({"seconds": 3600}, "output_expires_after.anchor",
         "Missing required parameter: 'output_expires_after.anchor'."),
    ],
)  # fmt: skip
def test_output_expires_after_out_of_range_is_400(stack, value, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client.batches.create(
            input_file_id=_upload(stack, [_chat("a", 4)]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"output_expires_after": value},
        )
    error = caught.value.body
    assert (error["type"], error["param"], error["message"]) == (
        "invalid_request_error", param, message,
    )  # fmt: skip


def test_running_batch_keeps_its_expired_input_until_it_ends(stack):
    with stack.gate("retention") as gate:
        # The last line holds the engine once admitted: the batch runs across the sweeps
        # however fast the machine; the lines before it finish first.
        lines = [_chat(f"r{i}", 16) for i in range(31)]
        lines.append(chat_line("held", f"write about the sea {gate.marker}", 16, ignore_eos=True))
        file_id = _upload(stack, lines)
        batch = stack.client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _until(
            lambda: stack.client.batches.retrieve(batch.id).request_counts.completed >= 1,
            90,
            "the batch to make progress",
        )
        row = _file(stack, file_id)
        _expire_now(stack, file_id)
        time.sleep(3)  # three sweeps while the batch runs
        assert stack.client.batches.retrieve(batch.id).status == "in_progress"
        assert _file(stack, file_id) is not None and _object(stack, row).exists()

    done = _until(
        lambda: (b := stack.client.batches.retrieve(batch.id)).status in TERMINAL and b,
        240,
        "the batch to finish",
    )
    assert done.status == "completed", done
    assert done.request_counts.completed == len(lines) and done.request_counts.failed == 0
    out_id = done.output_file_id
    assert len(stack.client.files.content(out_id).text.splitlines()) == len(lines)

    # Now the batch has ended, the sweep deletes its expired input.
    _until(
        lambda: _file(stack, file_id) is None and not _object(stack, row).exists(),
        15,
        "the sweep to delete the used input (row and stored object)",
    )

    # The output file expires settings.file_expiry_s (30 days by default) after the finalize.
    out = _file(stack, out_id)
    completed_at = datetime.fromtimestamp(done.completed_at, UTC)
    assert abs((out["expires_at"] - completed_at).total_seconds() - 30 * 24 * 3600) < 60
    assert stack.client.files.retrieve(out_id).expires_at == int(out["expires_at"].timestamp())
    _expire_now(stack, out_id)
    _until(
        lambda: _file(stack, out_id) is None and not _object(stack, out).exists(),
        15,
        "the sweep to delete the output file (row and stored object)",
    )
    with pytest.raises(openai.NotFoundError):
        stack.client.files.content(out_id)


def test_deleting_a_batch_output_file_drops_its_results_and_chunks(stack):
    """``DELETE /v1/files/{output}`` means the results are gone: the results route stops
    serving them and the batch's checkpoint chunks leave storage, though no retention sweep
    will ever meet another file of the batch."""
    import httpx

    from testkit.service.stack import API_KEY

    batch = stack.client.batches.create(
        input_file_id=_upload(stack, [_chat(f"d{i}", 3) for i in range(6)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = _until(
        lambda: (b := stack.client.batches.retrieve(batch.id)).status in TERMINAL and b,
        60,
        "the batch",
    )
    assert batch.status == "completed" and batch.error_file_id is None, batch
    http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert len(http.get(f"/batches/{batch.id}/results").json()["data"]) == 6
    chunks = Path(stack.env["BATCHD_STORAGE_URL"]) / "batches" / batch.id
    assert any(chunks.rglob("*.jsonl"))

    stack.client.files.delete(batch.output_file_id)
    assert http.get(f"/batches/{batch.id}/results").json()["data"] == []
    assert not any(chunks.rglob("*.jsonl")) if chunks.exists() else True
