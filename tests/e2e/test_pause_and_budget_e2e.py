"""Pausing a batch and a batch's token budget, on the whole service (API, control and model
workers, beat, Postgres, Redis, the demo model), driven through the official ``openai`` client
and HTTP. Work is held with the engine gate, never by timing: a paused batch's lines in flight
finish, nothing of it starts while another batch takes the capacity and completes, and the
resumed batch ends with every line exactly once. A small budget ends its batch ``completed``
with ``budget_exhausted`` lines, which a retry runs."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select, update
from typer.testing import CliRunner

from cli.main import app
from cli.perf.service import wait_for
from core.database.tables import Batch, Shard, WebhookDelivery
from testkit.builders.lines import chat_line, jsonl
from testkit.service.stack import API_KEY
from tests.e2e.test_webhooks import Receiver, verify_signature

pytestmark = [pytest.mark.services, pytest.mark.slow]

STACK_ENV = {
    "BATCHD_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    "BATCHD_RELEASE_SWEEP_INTERVAL_S": "1",
}
TERMINAL = ("completed", "failed", "expired", "cancelled")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _batchd(stack, *args: str) -> Any:
    return CliRunner().invoke(
        app, [*args, "--base-url", stack.base_url, "--api-key", API_KEY], catch_exceptions=False
    )


def _http(stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )


def _create(stack, lines: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    file = stack.client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    with _http(stack) as http:
        got = http.post(
            "/batches",
            json={
                "input_file_id": file.id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                **extra,
            },
        )
    assert got.status_code == 200, got.text
    return got.json()


def _get(stack, batch_id: str) -> dict[str, Any]:
    with _http(stack) as http:
        return http.get(f"/batches/{batch_id}").json()


def _wait(stack, batch_id: str, timeout: float, until=lambda b: b["status"] in TERMINAL):
    box: dict[str, Any] = {}

    def done() -> bool:
        box["b"] = _get(stack, batch_id)
        return bool(until(box["b"]))

    wait_for(done, timeout, f"batch {batch_id}", lambda: stack.log("model")[-3000:])
    return box["b"]


def _lines(stack, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = stack.client.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _db(stack):
    return create_engine(stack.env["BATCHD_DATABASE_URL"])


def _shards(stack, batch_id: str) -> list[Any]:
    engine = _db(stack)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(
                    select(Shard.index, Shard.status, Shard.attempts, Shard.released_at)
                    .where(Shard.batch_id == batch_id)
                    .order_by(Shard.index)
                )
            )
    finally:
        engine.dispose()


def _events(stack, batch_id: str) -> list[str]:
    engine = _db(stack)
    try:
        with engine.connect() as conn:
            return sorted(
                conn.scalars(
                    select(WebhookDelivery.event_type).where(WebhookDelivery.batch_id == batch_id)
                )
            )
    finally:
        engine.dispose()


def test_pause_lets_in_flight_lines_finish_gives_capacity_away_and_resumes_exactly_once(
    stack, receiver
):
    with stack.gate("pause") as gate:
        # 64 lines, 16 a shard: two shards run (two per worker), the gated first line holds
        # the engine with their first lines in flight, the other shards wait.
        lines = [chat_line("p00", f"{gate.marker} hold here", 4)]
        lines += [chat_line(f"p{i:02d}", f"pause line {i}", 4) for i in range(1, 64)]
        ids = [line["custom_id"] for line in lines]
        batch = _create(stack, lines, webhook_url=receiver.url("/pause"))
        wait_for(lambda: "engine gate pause holding" in stack.log("model"), 120, "the hold")
        with _http(stack) as http:
            paused = http.post(f"/batches/{batch['id']}/pause")
            assert paused.status_code == 200, paused.text
            assert paused.json()["paused"] is True
            assert paused.json()["status"] == "in_progress"  # the SDK's set: the flag says it
            assert paused.json()["paused_at"] is not None
            again = http.post(f"/batches/{batch['id']}/pause")  # idempotent
            assert (
                again.status_code == 200 and again.json()["paused_at"] == paused.json()["paused_at"]
            )
        # The official client parses the batch object, extension fields kept.
        sdk = stack.client.batches.retrieve(batch["id"])
        assert sdk.status == "in_progress" and getattr(sdk, "paused", None) is True
        wait_for(
            lambda: f"batch {batch['id']} is paused" in stack.log("model"), 60, "the pause seen"
        )
    # The gate is open: the lines in flight finish; the shards hand back what is left.
    wait_for(
        lambda: all(s.status in ("pending", "done") for s in _shards(stack, batch["id"])),
        120,
        "the paused batch's shards to stop",
    )
    held = _get(stack, batch["id"])
    assert held["request_counts"]["completed"] >= 1  # the gated line, in flight, finished
    assert held["request_counts"]["completed"] < len(ids)
    # Another batch takes the capacity and completes while this one stays paused.
    other = _create(stack, [chat_line(f"o{i}", f"other {i}", 4) for i in range(6)])
    assert _wait(stack, other["id"], 120)["status"] == "completed"
    still = _get(stack, batch["id"])
    assert still["paused"] is True and still["status"] == "in_progress"
    assert still["request_counts"] == held["request_counts"]  # nothing new ran
    shards = _shards(stack, batch["id"])
    assert all(s.status in ("pending", "done") for s in shards)
    assert all(s.released_at is None for s in shards if s.status == "pending")
    # Resume (the CLI's verb): it completes, every line exactly once, none lost.
    resumed = _batchd(stack, "resume", batch["id"])
    assert resumed.exit_code == 0, resumed.output
    assert resumed.output.strip() == f"{batch['id']} in_progress"
    done = _wait(stack, batch["id"], 240)
    assert done["status"] == "completed", done
    out = _lines(stack, done["output_file_id"])
    err = _lines(stack, done["error_file_id"])
    assert not err, err[:2]
    assert Counter(r["custom_id"] for r in out) == Counter(ids)
    assert [r["custom_id"] for r in out] == ids
    events = _events(stack, batch["id"])
    assert events == ["batch.completed", "batch.paused", "batch.resumed"], events
    # Each event delivered, signed with the batch's secret, in the order it happened.
    delivered = receiver.wait("/pause", 3, 60)
    types = [json.loads(r["body"])["type"] for r in delivered]
    assert sorted(types) == events and types[-1] == "batch.completed", types
    assert types.index("batch.paused") < types.index("batch.resumed")
    assert all(verify_signature(batch["webhook_secret"], r) for r in delivered)
    # A completed batch is neither paused nor resumed: 409, saying why.
    with _http(stack) as http:
        for verb in ("pause", "resume"):
            refused = http.post(f"/batches/{batch['id']}/{verb}")
            assert refused.status_code == 409, refused.text
            assert "completed" in refused.json()["error"]["message"]
        assert http.post("/batches/batch_nope/pause").status_code == 404
        message_batch = http.post("/batches/msgbatch_0123/pause")
        assert message_batch.status_code == 404
        assert "Message Batches API has no pause" in message_batch.json()["error"]["message"]
    refused_cli = _batchd(stack, "pause", batch["id"])
    assert refused_cli.exit_code == 1 and "completed" in refused_cli.output


def test_cancel_a_paused_batch(stack):
    with stack.gate("cancel_paused") as gate:
        lines = [chat_line("c00", f"{gate.marker} hold", 4)]
        lines += [chat_line(f"c{i:02d}", f"cancel line {i}", 4) for i in range(1, 40)]
        batch = _create(stack, lines)
        wait_for(lambda: "engine gate cancel_paused holding" in stack.log("model"), 120, "hold")
        paused = _batchd(stack, "pause", batch["id"])  # the CLI's verb
        assert paused.exit_code == 0, paused.output
        assert paused.output.strip() == f"{batch['id']} in_progress paused"
        shown = _batchd(stack, "status", batch["id"])
        assert "paused" in shown.output and "batchd resume" in shown.output, shown.output
        with _http(stack) as http:
            cancelled = http.post(f"/batches/{batch['id']}/cancel")
            assert cancelled.status_code == 200, cancelled.text
    done = _wait(stack, batch["id"], 120)
    assert done["status"] == "cancelled", done
    out = _lines(stack, done["output_file_id"])
    err = _lines(stack, done["error_file_id"])
    assert Counter(r["custom_id"] for r in out + err) == Counter(x["custom_id"] for x in lines)


def test_a_paused_batch_expires_when_its_window_ends(stack):
    """The window's clock runs on while paused: a paused batch whose deadline passes expires,
    its results kept and its unrun lines batch_expired, each line once."""
    with stack.gate("expire_paused") as gate:
        lines = [chat_line("e00", f"{gate.marker} hold", 4)]
        lines += [chat_line(f"e{i:02d}", f"expiry line {i}", 4) for i in range(1, 40)]
        batch = _create(stack, lines)
        wait_for(lambda: "engine gate expire_paused holding" in stack.log("model"), 120, "hold")
        with _http(stack) as http:
            assert http.post(f"/batches/{batch['id']}/pause").status_code == 200
        wait_for(
            lambda: f"batch {batch['id']} is paused" in stack.log("model"), 60, "the pause seen"
        )
    wait_for(
        lambda: all(s.status in ("pending", "done") for s in _shards(stack, batch["id"])),
        120,
        "the paused batch's shards to stop",
    )
    # Its deadline comes now (set in the row, not waited for).
    engine = _db(stack)
    try:
        with engine.begin() as conn:
            conn.execute(
                update(Batch)
                .where(Batch.id == batch["id"])
                .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
    finally:
        engine.dispose()
    done = _wait(stack, batch["id"], 120)
    assert done["status"] == "expired", done
    out = _lines(stack, done["output_file_id"])
    err = _lines(stack, done["error_file_id"])
    assert out  # what ran before the pause is kept
    assert err and all(r["error"]["code"] == "batch_expired" for r in err)
    assert Counter(r["custom_id"] for r in out + err) == Counter(x["custom_id"] for x in lines)


def test_a_budget_ends_the_batch_completed_with_budget_exhausted_lines_and_a_retry_runs_them(
    stack,
):
    lines = [
        chat_line(f"b{i:02d}", f"budget line {i} says", MAX_TOKENS, ignore_eos=True)
        for i in range(12)
    ]
    ids = [line["custom_id"] for line in lines]
    # Over budget: the prompts alone do not fit, and the error gives the count and the budget.
    refused = _wait(stack, _create(stack, lines, max_total_tokens=20)["id"], 60)
    assert refused["status"] == "failed", refused
    (error,) = refused["errors"]["data"]
    assert error["code"] == "token_budget_exceeded"
    assert "max_total_tokens=20" in error["message"] and "prompts alone" in error["message"]
    # The prompts as validation counts them (an estimate counts them the same way), plus
    # one line's output: the lines that run first spend it before the last lines start.
    with _http(stack) as http:
        estimate = http.post(
            "/batches/estimate",
            json={
                "input_file_id": refused["input_file_id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
    assert estimate.status_code == 200, estimate.text
    budget = estimate.json()["prompt_tokens"] + MAX_TOKENS
    batch = _create(stack, lines, max_total_tokens=budget)
    assert batch["max_total_tokens"] == budget
    done = _wait(stack, batch["id"], 120)
    assert done["status"] == "completed", done
    out = _lines(stack, done["output_file_id"])
    err = _lines(stack, done["error_file_id"])
    assert Counter(r["custom_id"] for r in out + err) == Counter(ids)  # each exactly once
    assert out and err, (budget, done["usage"])
    for line in err:
        assert line["response"]["status_code"] == 429
        error = line["response"]["body"]["error"]
        assert error["code"] == "budget_exhausted" and error["type"] == "insufficient_quota"
        assert f"max_total_tokens={budget}" in error["message"]
    spent = done["usage"]["total_tokens"]
    shown = _batchd(stack, "status", batch["id"])
    assert f"{spent} of {budget} spent" in shown.output, shown.output
    assert done["max_total_tokens"] == budget
    # Overshot only by what was in flight (and, across shards, not yet checkpointed): a few
    # lines at most, never the whole file.
    assert budget <= spent <= budget + 4 * (MAX_TOKENS + 32)
    assert done["request_counts"] == {
        "total": len(ids),
        "completed": len(out),
        "failed": len(err),
    }
    # The retry (the CLI's) runs the budget_exhausted lines, under a budget of its own.
    made = _batchd(
        stack, "retry", batch["id"], "--include", "budget_exhausted",
        "--max-total-tokens", "1000000", "--json",
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    retry = json.loads(made.output)
    assert retry["max_total_tokens"] == 1_000_000
    retried = _wait(stack, retry["id"], 120)
    assert retried["status"] == "completed", retried
    rerun = _lines(stack, retried["output_file_id"])
    assert sorted(r["custom_id"] for r in rerun) == sorted(r["custom_id"] for r in err)
