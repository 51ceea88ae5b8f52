"""Estimates, projected completions and deadlines, end to end (API, control and model workers
and beat on Postgres and Redis, the demo model served under a name of this module's own, so
no other module's batches count as its history).

- ``POST /v1/batches/estimate`` validates the whole file as validation does (errors with
  their line numbers), counts prompt tokens exactly as the model's tokenizer does, creates
  nothing, and gives null times with a reason until the model has run something;
- completion windows: ``7d`` accepted, out-of-range and malformed windows refused naming
  ``completion_window``; a key's shortest window is an entitlement (403);
- earliest deadline first: a tenant's 600-line 24h job, then 5 s later its 1,200-line 1h job
  of the same priority: the 1h job finishes first (sharing equally, the smaller, earlier job
  would); both carry ``estimated_completion_at`` while they run;
- a batch whose window is too short for its work is marked ``at_risk`` while it runs.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from core.launch import QUIET, beat_command, control_worker_command, model_worker_command
from testkit.builders.lines import chat_line, jsonl
from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import MODEL_WORKER_GATE, FileGate, closed_gate
from testkit.service.stack import API_KEY, Procs, api_command, private_redis, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

MODEL = f"edf-demo-{secrets.token_hex(3)}"
FIRST, SECOND = 600, 1200  # the sizes
MAX_TOKENS = 16


@dataclass
class Edf:
    url: str
    env: dict[str, str]
    procs: Procs
    http: Any  # httpx.Client with the static key

    def upload(self, lines: list[Any], key: str | None = None) -> str:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        r = self.http.post(
            "/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(lines), "application/jsonl")},
            headers=headers,
        )
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def post(self, path: str, body: dict[str, Any], key: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        return self.http.post(path, json=body, headers=headers)

    def batch(self, batch_id: str, key: str | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        r = self.http.get(f"/batches/{batch_id}", headers=headers)
        assert r.status_code == 200, r.text
        return r.json()


def _worker(kind: str, root: Path) -> list[str]:
    if kind == "beat":
        return beat_command(root / "beat-schedule", extra=["--loglevel", "INFO"])
    if kind == "control":
        return control_worker_command(f"{kind}@edf", extra=QUIET)
    return model_worker_command([MODEL], 4, f"{kind}@edf", extra=[*QUIET, *MODEL_WORKER_GATE])


@pytest.fixture(scope="module")
def edf(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edf]:

    from core.llms.demo import build

    build("llama-tiny")
    root = tmp_path_factory.mktemp("edf")
    # A broker of its own: the estimate's answer comes from whichever control worker takes
    # the task, and it must be this stack's (its storage holds the file).
    with private_redis(redis_url, root) as broker:
        yield from _stack(pg_url, broker, root)


def _stack(pg_url: str, broker: str, root: Path) -> Iterator[Edf]:
    import httpx

    port = free_port()
    env = stack_env(
        pg_url,
        broker,
        root,
        BATCHD_MODELS=json.dumps({MODEL: "demo:llama-tiny"}),
        BATCHD_SHARD_MAX_REQUESTS="50",
        BATCHD_WORKER_SHARD_CONCURRENCY="4",
        BATCHD_MAX_RELEASED_SHARDS_PER_MODEL="4",
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        BATCHD_CHECKPOINT_EVERY="16",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
        BATCHD_ETA_REFRESH_INTERVAL_S="0.5",
        BATCHD_METRICS_CACHE_S="0",
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 32}),
        **{GATE_ENV: str(root / "gates")},
    )
    procs = Procs(root)
    try:
        procs.start("api", api_command(port), env)
        for kind in ("control", "model", "beat"):
            procs.start(kind, _worker(kind, root), env)

        def ready() -> bool:
            procs.check_alive()
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
            return (
                up
                and "ready." in procs.log("control")
                and f"model {MODEL} ready" in (procs.log("model"))
            )

        wait_for(ready, 120, "the API, the workers and the model", procs.logs)
        url = f"http://127.0.0.1:{port}/v1"
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=90
        ) as http:
            yield Edf(url, env, procs, http)
    finally:
        procs.stop_all()


def lines(prefix: str, n: int, max_tokens: int = MAX_TOKENS, **body: Any) -> list[dict[str, Any]]:
    return [
        chat_line(f"{prefix}-{i}", f"item {i} of {prefix}", max_tokens, model=MODEL, **body)
        for i in range(n)
    ]


def tenant_key(env: dict[str, str], tenant: str, **entitlements: Any) -> str:
    from core.database.auth import create_key
    from core.database.sessions import session_scope

    with session_scope(env["BATCHD_DATABASE_URL"]) as session:
        _row, plaintext = create_key(session, tenant, "edf", **entitlements)
    return plaintext


def scalars(edf: Edf, *queries: tuple[str, dict[str, Any]]) -> list[Any]:
    """One value of each SQL query, read from the stack's database."""
    from sqlalchemy import create_engine, text

    engine = create_engine(edf.env["BATCHD_DATABASE_URL"])
    with engine.connect() as conn:
        values = [conn.execute(text(sql), params).scalar_one() for sql, params in queries]
    engine.dispose()
    return values


def last_shard_end(edf: Edf, batch_id: str) -> Any:
    """When the batch's last shard changed (its end), to the microsecond: the API's timestamps
    are whole seconds, and two batches can end in the same one."""
    sql = "SELECT max(updated_at) FROM shards WHERE batch_id = :b"
    return scalars(edf, (sql, {"b": batch_id}))[0]


def counts(edf: Edf) -> tuple[int, int]:
    """Batches, and files other than results: a batch of an earlier test of this module that
    ends meanwhile adds its output and error files, which say nothing of the request."""
    batches, files = scalars(
        edf,
        ("SELECT count(*) FROM batches", {}),
        ("SELECT count(*) FROM files WHERE purpose <> 'batch_output'", {}),
    )
    return batches, files


def wait_done(edf: Edf, batch_ids: list[str], timeout: float, key: str | None = None):
    """Poll until every batch ends; each one's observations while it ran, and its end."""
    seen: dict[str, list[dict[str, Any]]] = {b: [] for b in batch_ids}
    ended: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(batch_ids):
        assert time.monotonic() < deadline, f"not done in {timeout}s: {seen}{edf.procs.logs()}"
        for b in batch_ids:
            if b in ended:
                continue
            obj = edf.batch(b, key)
            if obj["status"] in ("completed", "failed", "expired", "cancelled"):
                ended[b] = obj
            else:
                seen[b].append(obj)
        time.sleep(0.25)
    return seen, ended


# ---------------------------------------------------------------------------------------------


def test_estimate_validates_and_counts_exactly_and_creates_nothing(edf: Edf):
    from transformers import AutoTokenizer

    from core.llms.demo import build

    good = lines("est", 6, max_tokens=5)
    bad = [
        good[0],
        "{not json",
        good[1],
        {**good[2], "custom_id": "est-0"},  # duplicate of line 1
        good[3],
        chat_line("est-x", "hello", 5, model="no-such-model"),
        good[4],
        good[5],
    ]
    file_id = edf.upload(bad)
    before = counts(edf)
    r = edf.post(
        "/batches/estimate",
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert r.status_code == 200, r.text
    est = r.json()
    assert counts(edf) == before  # no batch, no file
    assert est["object"] == "batch.estimate"
    assert est["total_requests"] == 8
    assert est["valid_requests"] == 5
    assert [(e["line"], e["code"]) for e in est["errors"]] == [
        (2, "invalid_json_line"),
        (4, "duplicate_custom_id"),
        (6, "model_not_found"),
    ]
    # Exact prompt tokens: the model's own tokenizer and chat template, line by line.
    tok = AutoTokenizer.from_pretrained(build("llama-tiny"))
    valid = [good[0], good[1], good[3], good[4], good[5]]
    expected = 0
    for x in valid:
        ids = tok.apply_chat_template(x["body"]["messages"], add_generation_prompt=True)
        expected += len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert est["prompt_tokens"] == expected
    assert est["max_completion_tokens"] == 5 * 5
    assert est["per_model"][MODEL]["requests"] == 5
    assert est["per_model"][MODEL]["prompt_tokens"] == expected
    # Nothing of this model has run yet: no time is made up.
    assert est["estimated_start_at"] is None and est["estimated_completion_at"] is None
    assert est["fits_window"] is None
    assert "No throughput observed" in est["reason"]


def test_completion_windows_range_and_errors(edf: Edf):
    file_id = edf.upload(lines("win", 2))
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    for window, words in (
        ("8d", "longer than the maximum"),
        ("0h", "completion_window"),
        ("2w", "completion_window"),
        ("soon", "completion_window"),
    ):
        for path in ("/batches/estimate", "/batches"):
            r = edf.post(path, {**body, "completion_window": window})
            assert r.status_code == 400, (window, path, r.text)
            error = r.json()["error"]
            assert error["param"] == "completion_window", error
            assert words in error["message"], error
    r = edf.post("/batches", {**body, "completion_window": "7d"})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["expires_at"] - batch["created_at"] in (7 * 86400, 7 * 86400 + 1)
    assert edf.post(f"/batches/{batch['id']}/cancel", {}).status_code == 200


def test_a_keys_shortest_window_is_an_entitlement(edf: Edf):
    key = tenant_key(edf.env, "tenant-window", min_completion_window_s=6 * 3600)
    file_id = edf.upload(lines("ent", 2), key=key)
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    before = counts(edf)
    for path in ("/batches", "/batches/estimate"):
        r = edf.post(path, {**body, "completion_window": "1h"}, key=key)
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["code"] == "completion_window_not_allowed"
        assert error["param"] == "completion_window"
        assert "6h" in error["message"]
    assert counts(edf) == before
    assert edf.post("/batches/estimate", {**body, "completion_window": "6h"}, key=key).is_success


def test_a_tenants_one_hour_job_overtakes_its_earlier_day_long_job(edf: Edf):
    key = tenant_key(edf.env, "tenant-edf")
    # The day job's first line (its longest prompt, admitted first) holds the engine until the
    # hour job has arrived and runs: most of the day job is still to run then, however fast
    # the machine.
    gate = FileGate(Path(edf.env[GATE_ENV]), "edf")
    gate.close()
    day_lines = lines("day", FIRST)
    day_lines[0] = chat_line("day-0", f"item 0 of day {gate.marker}", MAX_TOKENS, model=MODEL)
    first = edf.upload(day_lines, key=key)
    second = edf.upload(lines("hour", SECOND), key=key)
    body = {"endpoint": "/v1/chat/completions"}
    try:
        day = edf.post(
            "/batches", {**body, "input_file_id": first, "completion_window": "24h"}, key
        )
        assert day.status_code == 200, day.text
        hour = edf.post(
            "/batches", {**body, "input_file_id": second, "completion_window": "1h"}, key
        )
        assert hour.status_code == 200, hour.text
        ids = [day.json()["id"], hour.json()["id"]]
        wait_for(lambda: edf.batch(ids[1], key)["status"] == "in_progress", 120, "the hour job",
                 edf.procs.logs)  # fmt: skip
        day_done_then = edf.batch(ids[0], key)["request_counts"]["completed"]
    finally:
        gate.open()
    seen, ended = wait_done(edf, ids, 240, key)
    day_end, hour_end = (ended[b] for b in ids)
    assert day_end["status"] == hour_end["status"] == "completed", ended
    assert day_end["request_counts"]["completed"] == FIRST
    assert hour_end["request_counts"]["completed"] == SECOND
    # Earliest deadline first: the 1h job ends first although it came second and is larger.
    # The API's times are whole seconds: under load both can end in the same one, so the order
    # of their last shards' ends (to the microsecond) is what shows who finished first.
    assert hour_end["completed_at"] <= day_end["completed_at"], (hour_end, day_end)
    ends = [last_shard_end(edf, b) for b in ids]
    assert ends[1] < ends[0], (
        f"the 1h job's last shard ended {ends[1]}, the day job's {ends[0]}; "
        f"the day job had {day_done_then} of {FIRST} done when the 1h job arrived"
    )
    # While running, each carried a projected completion (from its own progress), and no
    # deadline was at risk.
    for b in ids:
        running = [o for o in seen[b] if o["status"] == "in_progress"]
        assert any(o["estimated_completion_at"] for o in running), seen[b]
        assert not any(o["at_risk"] for o in running)
    assert "estimated_completion_at" not in day_end or day_end["estimated_completion_at"] is None

    # Now that the model has a history, an estimate has times, in order.
    est = edf.post(
        "/batches/estimate", {**body, "input_file_id": second, "completion_window": "1h"}, key
    ).json()
    assert est["reason"] is None, est
    assert est["per_model"][MODEL]["throughput_tokens_per_s"] > 0
    assert est["estimated_start_at"] <= est["estimated_completion_at"] <= est["expires_at"]
    assert est["fits_window"] is True


def test_a_batch_that_cannot_make_its_window_is_marked_at_risk(edf: Edf):
    # It cannot end in its window however fast a step is: a line of its second shard (the
    # shortest, admitted last in it) holds the engine until the batch is cancelled.
    risky = lines("risk", SECOND, max_tokens=128, ignore_eos=True)
    with closed_gate(Path(edf.env[GATE_ENV]), "at_risk") as gate:
        risky[99] = chat_line("risk-99", f"risk {gate.marker}", 4, model=MODEL, ignore_eos=True)
        _at_risk(edf, risky)


def _at_risk(edf: Edf, risky: list[dict[str, Any]]) -> None:
    file_id = edf.upload(risky)
    r = edf.post(
        "/batches",
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "8s"},
    )
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]

    def marked() -> bool:
        obj = edf.batch(batch_id)
        assert obj["status"] in ("validating", "in_progress"), obj
        return bool(obj["at_risk"])

    wait_for(marked, 8, "the batch marked at risk before its deadline", edf.procs.logs)
    obj = edf.batch(batch_id)
    assert obj["estimated_completion_at"] > obj["expires_at"]
    metrics = edf.http.get(edf.url.removesuffix("/v1") + "/metrics").text
    assert f'batchd_batches_at_risk{{model="{MODEL}"}} 1.0' in metrics
    edf.post(f"/batches/{batch_id}/cancel", {})
