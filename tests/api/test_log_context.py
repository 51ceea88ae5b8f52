"""With ``BATCHD_LOG_FORMAT=json`` the API's log lines about a batch carry its ``batch_id``, as
the workers' do: the create (known only once the route made it), retrieve and cancel (from the
path), a download of the batch's output file, and uvicorn's access line of each; a request
about no batch carries none."""

from __future__ import annotations

import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import launch
from testkit.builders.lines import chat_line
from tests.api.conftest import REPO_ROOT, Server, _wait_until_listening, free_port

pytestmark = pytest.mark.services


@pytest.fixture
def json_server(service_env: dict[str, str], tmp_path: Path, api_key: str) -> Iterator[Server]:
    port = free_port()
    env = {**os.environ, **service_env, "BATCHD_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "api.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            launch.api_command(port, log_level="info"),  # info: uvicorn's access lines too
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = Server(f"http://127.0.0.1:{port}", process, log_path, env, api_key)
    try:
        _wait_until_listening(server)
        yield server
    finally:
        process.terminate()
        process.wait(10)


def _records(server: Server) -> list[dict]:
    lines = server.log().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _access(records: list[dict], request_line: str) -> list[dict]:
    return [
        r
        for r in records
        if r["logger"] == "uvicorn.access" and f'"{request_line} ' in r["message"]
    ]


def test_batch_lines_carry_the_batch_id(json_server: Server, pg_url: str) -> None:
    from sqlalchemy import create_engine, text

    http = json_server.http()
    data = json.dumps(chat_line("a", "hello")).encode() + b"\n"
    upload = http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(data))}
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    created = http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200, created.text
    batch = created.json()["id"]
    assert http.get(f"/v1/batches/{batch}").status_code == 200
    assert http.get("/v1/batches").status_code == 200
    assert http.post(f"/v1/batches/{batch}/cancel").status_code == 200
    # The file stands in for the batch's output file (no worker runs here).
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE files SET purpose = 'batch_output' WHERE id = :f"), {"f": file_id}
        )
        conn.execute(
            text("UPDATE batches SET output_file_id = :f WHERE id = :b"),
            {"f": file_id, "b": batch},
        )
    engine.dispose()
    download = http.get(f"/v1/files/{file_id}/content")
    assert download.status_code == 200 and download.content == data

    records = _records(json_server)
    log = json_server.log()
    created_lines = [r for r in records if r["message"].startswith(f"batch {batch} created")]
    assert [r.get("batch_id") for r in created_lines] == [batch], log
    cancelling = [r for r in records if r["message"] == f"batch {batch} cancelling"]
    assert [r.get("batch_id") for r in cancelling] == [batch], log
    for request_line in (
        "POST /v1/batches",
        f"GET /v1/batches/{batch}",
        f"POST /v1/batches/{batch}/cancel",
        f"GET /v1/files/{file_id}/content",
    ):
        lines = _access(records, request_line)
        assert [r.get("batch_id") for r in lines] == [batch], (request_line, log)
    # Requests about no batch carry none, before or after one that did.
    for request_line in ("POST /v1/files", "GET /v1/batches"):
        lines = _access(records, request_line)
        assert len(lines) == 1 and "batch_id" not in lines[0], (request_line, log)


def test_an_unhandled_error_is_logged_with_its_batch(service_env: dict[str, str]) -> None:
    """The catch-all 500 handler runs in Starlette's outermost middleware: its line carries
    the batch too."""
    import logging

    from fastapi.testclient import TestClient

    from api.app import create_app
    from core.observability.logs import install
    from core.settings import get_settings

    app = create_app(get_settings())

    @app.get("/v1/batches/{batch_id}/explode")
    def explode(batch_id: str) -> None:
        raise RuntimeError("boom")

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    install([handler], "json")
    logger = logging.getLogger("batchd.api")
    logger.addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.get("/v1/batches/batch_x1/explode").status_code == 500
    finally:
        logger.removeHandler(handler)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    unhandled = [r for r in records if r["message"].startswith("unhandled error")]
    assert [r.get("batch_id") for r in unhandled] == ["batch_x1"], records


def test_x_request_id_is_returned_logged_and_sent_with_the_tasks(
    json_server: Server, redis_url: str
) -> None:
    """A caller's x-request-id comes back on the response and is on every line the call
    logged (uvicorn's access line included) and on the task message it enqueued; a call
    without one (or with one unfit for a log line) gets a fresh ``req_…``."""
    import redis

    from core.broker.queue import CONTROL_QUEUE

    http = json_server.http()
    data = json.dumps(chat_line("a", "hello")).encode() + b"\n"
    upload = http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(data))}
    )
    generated = upload.headers["x-request-id"]
    assert generated.startswith("req_") and len(generated) > 20
    created = http.post(
        "/v1/batches",
        headers={"x-request-id": "trace-7f3a"},
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200 and created.headers["x-request-id"] == "trace-7f3a"
    unfit = http.get("/v1/models", headers={"x-request-id": "two words " + "x" * 200})
    assert unfit.headers["x-request-id"].startswith("req_")

    records = _records(json_server)
    batch = created.json()["id"]
    mine = [r for r in records if r.get("http_request_id") == "trace-7f3a"]
    assert any(r["message"].startswith(f"batch {batch} created") for r in mine), records
    assert _access(mine, "POST /v1/batches"), records
    assert any(r.get("http_request_id") == generated for r in _access(records, "POST /v1/files"))

    messages = [json.loads(m) for m in redis.Redis.from_url(redis_url).lrange(CONTROL_QUEUE, 0, -1)]
    sent = [m["headers"] for m in messages if batch in str(m["headers"].get("argsrepr"))]
    assert [h.get("x_request_id") for h in sent] == ["trace-7f3a"], messages
