"""Results while a batch runs, and retries, against the whole service (API, control and model
workers, beat on Postgres and Redis, the tiny demo model): the pages' union equals the final
files line for line across a model worker SIGKILLed mid-batch and across a cancel; cursor,
limit and tenancy errors; a retry of the cancelled lines; and the ``batchd results --follow``,
``retry`` and ``download --with-retries`` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cli.exit_codes import ExitCode
from cli.main import app
from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL, chat_line
from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import MODEL_WORKER_GATE
from testkit.service.stack import API_KEY, REPO, Procs, api_command, celery_command, stack_env
from tests.e2e.conftest import Stack, _own_redis_db

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def rstack(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The e2e stack, with its processes at hand (a test kills the model worker) and a
    quick reclaim of a dead worker's shards."""
    import redis
    from openai import OpenAI

    from core.llms.demo import build

    build("llama-tiny")
    root = tmp_path_factory.mktemp("results")
    broker = _own_redis_db(redis_url)
    redis.Redis.from_url(broker).flushdb()
    port = free_port()
    env = stack_env(
        pg_url,
        broker,
        root,
        BATCHD_CHECKPOINT_EVERY="2",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS="8",
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4, "admission": "fcfs"}),
        BATCHD_HEARTBEAT_INTERVAL_S="0.5",
        BATCHD_SHARD_STALE_AFTER_S="3",
        BATCHD_RECLAIM_SWEEP_INTERVAL_S="1",
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        BATCHD_RELEASE_RESEND_AFTER_S="6",
        BATCHD_MAX_SHARD_ATTEMPTS="20",
        BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
        **{GATE_ENV: str(root / "gates")},
    )
    procs = Procs(root)
    try:
        procs.start("api", api_command(port), env)
        procs.start("control", celery_command("control", "control", root), env)
        procs.start("model", [*celery_command("model", "model", root), *MODEL_WORKER_GATE], env)
        procs.start("beat", celery_command("beat", "beat", root), env)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            procs.check_alive()
            try:
                up = httpx.get(f"{base}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
            return up and f"model {MODEL} ready" in procs.log("model")

        wait_for(ready, 120, "the API, the workers and the model", procs.logs)
        stack = Stack(f"{base}/v1", env, root, OpenAI(base_url=f"{base}/v1", api_key=API_KEY))
        stack.procs = procs  # type: ignore[attr-defined]
        yield stack
    finally:
        procs.stop_all()


def _http(stack: Stack, key: str = API_KEY) -> httpx.Client:
    return httpx.Client(
        base_url=stack.base_url + "/", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def _submit(stack: Stack, rows: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file = stack.client.files.create(file=("in.jsonl", data), purpose="batch")
    return stack.client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def _final_lines(stack: Stack, batch: Any) -> list[dict[str, Any]]:
    lines = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            text = stack.client.files.content(file_id).text
            lines += [json.loads(x) for x in text.splitlines() if x.strip()]
    return lines


def _page(http: httpx.Client, batch_id: str, after: str | None, limit: int) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if after:
        params["after"] = after
    response = http.get(f"batches/{batch_id}/results", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _drain(http: httpx.Client, batch_id: str, after: str | None, limit: int, into: list) -> Any:
    while True:
        page = _page(http, batch_id, after, limit)
        into += page["data"]
        if page["data"]:
            assert page["first_id"] == page["data"][0]["id"]
            assert page["last_id"] == page["data"][-1]["id"]
            after = page["last_id"]
        if not page["has_more"]:
            return after


def _by_id(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(lines, key=lambda r: r["id"])


def _batchd(stack: Stack, *args: str):
    return CliRunner().invoke(
        app, [*args, "--base-url", stack.base_url, "--api-key", API_KEY], catch_exceptions=False
    )


def _rows(prefix: str, text: str, long: int, long_tokens: int = 120) -> list[dict[str, Any]]:
    """Four quick requests first (results show up at once), then ``long`` long ones."""
    quick = [chat_line(f"{prefix}{i:02d}", f"{text} {i}", 4) for i in range(4)]
    return quick + [
        chat_line(f"{prefix}{i:02d}", f"{text} {i}", long_tokens, ignore_eos=True)
        for i in range(4, 4 + long)
    ]


def test_pages_equal_the_files_across_a_model_worker_sigkill(rstack) -> None:
    """Lines committed before the kill, by the reclaimed shard's resumed attempt, and the
    batch_cancelled lines of the cancel that ends the batch: each paged once, all of them."""
    stack, procs = rstack, rstack.procs
    # Long requests, so the first shard has committed its quick lines but not its long ones
    # when the worker is killed, however fast a step is (the batch is cancelled once the
    # resumed attempt has committed more, not run to its end).
    rows = _rows("k", "mountain", 28, long_tokens=900)
    batch_id = _submit(stack, rows)
    seen: list[dict[str, Any]] = []
    after = None
    killed_at = resumed_at = None
    with _http(stack) as http:
        deadline = time.monotonic() + 240
        while True:
            batch = stack.client.batches.retrieve(batch_id)
            after = _drain(http, batch_id, after, 5, seen)
            if batch.status in TERMINAL:
                after = _drain(http, batch_id, after, 5, seen)  # its end commits its last lines
                break
            if killed_at is None and len(seen) >= 2:
                assert batch.status == "in_progress"
                killed_at = len(seen)
                procs.kill("model")
                model_2 = [*celery_command("model", "model-2", stack.root), *MODEL_WORKER_GATE]
                procs.start("model-2", model_2, stack.env)
            elif killed_at is not None and resumed_at is None:
                if "resumes:" in procs.log("model-2"):
                    resumed_at = len(seen)
            elif resumed_at is not None and len(seen) >= resumed_at + 2:
                stack.client.batches.cancel(batch_id)  # no need to wait for the rest
                resumed_at = len(rows)
            assert time.monotonic() < deadline, procs.logs()
            time.sleep(0.2)
    assert killed_at is not None and killed_at < len(rows), "the kill came after the end"
    assert "resumes:" in procs.log("model-2"), procs.logs()  # a killed shard resumed
    assert batch.status in ("completed", "cancelled"), procs.logs()
    assert len({line["id"] for line in seen}) == len(seen), "a line was paged twice"
    final = _final_lines(stack, batch)
    assert len(final) == len(rows)
    assert _by_id(seen) == _by_id(final)
    print(f"killed after {killed_at} lines; {batch.status}; {len(final)} lines")

    # Only failed lines (none here) asked for: nothing to retry.
    with _http(stack) as http:
        response = http.post(f"batches/{batch_id}/retry", json={"include": ["failed"]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "nothing_to_retry"


def test_cursor_limit_and_tenancy_errors(rstack, monkeypatch) -> None:
    stack = rstack
    batch_id = _submit(stack, [chat_line("only", "hi", 2)])
    with _http(stack) as http:
        for params, param in (
            ({"limit": 0}, "limit"),
            ({"limit": 1001}, "limit"),
            ({"limit": "ten"}, "limit"),
            ({"after": "batch_req_000000000000000000000000"}, "after"),
            ({"after": "not an id!"}, "after"),
            ({"after": "x" * 65}, "after"),
        ):
            response = http.get(f"batches/{batch_id}/results", params=params)
            assert response.status_code == 400, (params, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (params, error)
            assert error["message"], error
        for method, path in (("GET", "results"), ("POST", "retry")):
            response = http.request(method, f"batches/batch_nope/{path}")
            assert response.status_code == 404, response.text
        response = http.post(f"batches/{batch_id}/retry", json={"include": ["everything"]})
        assert response.status_code == 400
        assert response.json()["error"]["param"].startswith("include"), response.text

    # Another tenant's batch is missing, for both routes.
    from core.database.auth import create_key
    from core.database.sessions import session_scope
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_DATABASE_URL", stack.env["BATCHD_DATABASE_URL"])
    get_settings.cache_clear()
    with session_scope() as session:
        _row, other = create_key(session, "results-other", "results test")
    with _http(stack, other) as http:
        assert http.get(f"batches/{batch_id}/results").status_code == 404
        assert http.post(f"batches/{batch_id}/retry").status_code == 404
    get_settings.cache_clear()


def test_follow_cancel_retry_and_download_with_retries(rstack, tmp_path: Path) -> None:
    stack = rstack
    # The last line holds the engine once admitted: the batch is still running when the
    # follower has lines, however fast a step is (it is cancelled then, not run to its end).
    rows = _rows("c", "river", 16, long_tokens=64)
    held = rows[-1]["custom_id"]
    with stack.gate("follow_cancel") as gate:
        rows[-1] = chat_line(held, f"river {gate.marker}", 64, ignore_eos=True)
        batch_id = _submit(stack, rows)
        partial = tmp_path / "partial.jsonl"
        follower = subprocess.Popen(
            [sys.executable, "-m", "cli", "results", batch_id, "--follow", "-o", str(partial),
             "--poll-interval", "0.2", "--timeout", "200", "--base-url", stack.base_url,
             "--api-key", API_KEY],
            cwd=REPO, env={**os.environ, **stack.env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:

            def lines_arrived() -> bool:
                return partial.exists() and len(partial.read_text().splitlines()) >= 2

            wait_for(lines_arrived, 120, "the follower to append lines", stack.procs.logs)
            assert stack.client.batches.retrieve(batch_id).status == "in_progress"
            with _http(stack) as http:  # a running batch cannot be retried
                response = http.post(f"batches/{batch_id}/retry")
            assert response.status_code == 409, response.text
            assert "in_progress" in response.json()["error"]["message"]
            stack.client.batches.cancel(batch_id)
            output, _ = follower.communicate(timeout=120)
        finally:
            if follower.poll() is None:
                follower.kill()
    assert follower.returncode == ExitCode.CANCELLED, output
    batch = stack.client.batches.retrieve(batch_id)
    assert batch.status == "cancelled"
    final = _final_lines(stack, batch)
    followed = [json.loads(x) for x in partial.read_text().splitlines()]
    assert _by_id(followed) == _by_id(final)  # batch_cancelled lines included
    cancelled = [r["custom_id"] for r in final if r.get("response") is None]
    assert cancelled and all(
        r["error"]["code"] == "batch_cancelled" for r in final if r.get("response") is None
    )

    with _http(stack) as http:
        response = http.post(f"batches/{batch_id}/retry", json={"include": ["expired"]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "nothing_to_retry"

    result = _batchd(
        stack, "retry", batch_id, "--wait", "--json", "--poll-interval", "0.2", "--timeout", "200"
    )
    assert result.exit_code == ExitCode.OK, result.output
    retry = json.loads(result.stdout)
    assert retry["metadata"]["retry_of"] == batch_id
    assert retry["request_counts"]["total"] == len(cancelled)
    from openai.types import Batch

    again = stack.client.batches.retrieve(retry["id"])  # an ordinary Batch for the SDK
    assert isinstance(again, Batch) and again.metadata["retry_of"] == batch_id
    sent = stack.client.files.content(again.input_file_id).text.splitlines()
    originals = {r["custom_id"]: json.dumps(r) for r in rows}
    assert sent == [originals[c] for c in sorted(cancelled)]  # the same lines, input order

    merged_path = tmp_path / "all.jsonl"
    result = _batchd(stack, "download", batch_id, "--with-retries", "-o", str(merged_path))
    assert result.exit_code == ExitCode.OK, result.output
    merged = [json.loads(x) for x in merged_path.read_text().splitlines()]
    assert [r["custom_id"] for r in merged] == [r["custom_id"] for r in rows]
    assert all(r["response"]["status_code"] == 200 for r in merged)

    # Without --follow: what is there, at once (resuming after the file's last line).
    result = _batchd(stack, "results", retry["id"], "-o", str(tmp_path / "r.jsonl"))
    assert result.exit_code == ExitCode.OK, result.output
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == len(cancelled)
    result = _batchd(stack, "results", retry["id"], "-o", str(tmp_path / "r.jsonl"))
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == len(cancelled)
