"""The metrics endpoints of a real service during a real batch: the API's ``/metrics`` and
each worker's exporter are scraped before, during and after one batch, and the counters must
have moved by exactly the batch's numbers (requests, tokens, shards, one finalize). With
``BATCHD_LOG_FORMAT=json`` every worker line is a JSON object, and the batch can be followed
by its id across the control and model workers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL, chat_line, create_batch
from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import MODEL_WORKER_GATE, FileGate
from testkit.metrics.metrics_lint import sample_problems
from testkit.metrics.scrape import Samples, scrape, total, value
from testkit.service.stack import API_KEY, Procs, api_command, stack_env
from testkit.service.stack import celery_command as celery

pytestmark = [pytest.mark.services, pytest.mark.slow]

NUM_REQUESTS = 20
TENANT = "default"  # the static key's tenant


def test_counters_move_by_exactly_the_batch(pg_url, private_broker, tmp_path, procs: Procs):
    import httpx
    from sqlalchemy import create_engine, text

    control_port, model_port, api_port = free_port(), free_port(), free_port()
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_CHECKPOINT_EVERY="3",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS="5",
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4}),
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        BATCHD_LOG_FORMAT="json",
        BATCHD_WORKER_METRICS_HOST="127.0.0.1",
        BATCHD_METRICS_CACHE_S="0",  # the gauges as they are now at every scrape
        **{GATE_ENV: str(tmp_path / "gates")},
    )
    procs.start("api", api_command(api_port), env)
    procs.start(
        "control",
        celery("control", "control", tmp_path),
        {**env, "BATCHD_WORKER_METRICS_PORT": str(control_port)},
    )
    procs.start("beat", celery("beat", "beat", tmp_path), env)
    procs.start(
        "model",
        [*celery("model", "model", tmp_path), *MODEL_WORKER_GATE],
        {**env, "BATCHD_WORKER_METRICS_PORT": str(model_port)},
    )
    procs.wait_log("model", f"model {MODEL} ready", 120)
    api_metrics = f"http://127.0.0.1:{api_port}/metrics"
    control_metrics = f"http://127.0.0.1:{control_port}/metrics"
    model_metrics = f"http://127.0.0.1:{model_port}/metrics"
    before = {
        "api": scrape(api_metrics),
        "control": scrape(control_metrics),
        "model": scrape(model_metrics),
    }

    client = httpx.Client(
        base_url=f"http://127.0.0.1:{api_port}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    # The last line holds the engine until the scrapes below have seen the work pending,
    # however fast the machine runs the rest.
    gate = FileGate(tmp_path / "gates", "metrics")
    gate.close()
    texts = [f"count the metrics {i}" for i in range(NUM_REQUESTS - 1)] + [gate.marker]
    data = b"".join(
        json.dumps(chat_line(f"m{i:02d}", text, 6 + i % 5, ignore_eos=True)).encode() + b"\n"
        for i, text in enumerate(texts)
    )
    batch_id = create_batch(client, data)

    def batch() -> dict[str, Any]:
        return client.get(f"/v1/batches/{batch_id}").json()

    # During the run: the API reports the model's pending work, the model worker its engine.
    during: dict[str, Samples] = {}

    def work_visible() -> bool:
        samples = scrape(api_metrics)
        during["api"] = samples
        # (the gauges are read by separate statements: one scrape may see the batch still
        # validating and its shards already there)
        return (
            total(samples, "batchd_pending_shards", model=MODEL) > 0
            and value(samples, "batchd_batches", status="in_progress") >= 1
        )

    wait_for(work_visible, 90, "pending work on /metrics", procs.logs)
    assert total(during["api"], "batchd_pending_tokens", model=MODEL) > 0
    engine_now = scrape(model_metrics)
    assert value(engine_now, "batchd_engine_up", model=MODEL) == 1
    assert value(engine_now, "batchd_engine_max_num_seqs", model=MODEL) == 4
    assert 0 <= value(engine_now, "batchd_engine_kv_cache_usage_perc", model=MODEL) <= 1
    gate.open()

    wait_for(lambda: batch()["status"] in ("completed", "failed"), 180, "the batch", procs.logs)
    final = batch()
    assert final["status"] == "completed", (final, procs.logs())
    counts, usage = final["request_counts"], final["usage"]
    assert counts["completed"] == NUM_REQUESTS

    after = {
        "api": scrape(api_metrics),
        "control": scrape(control_metrics),
        "model": scrape(model_metrics),
    }

    def moved(process: str, name: str, **labels: str) -> float:
        return value(after[process], name, **labels) - value(before[process], name, **labels)

    who = {"model": MODEL, "tenant": TENANT}
    assert moved("model", "batchd_requests_completed_total", **who) == counts["completed"]
    assert moved("model", "batchd_requests_failed_total", **who) == counts["failed"]
    assert moved("model", "batchd_prompt_tokens_total", **who) == usage["input_tokens"]
    assert moved("model", "batchd_completion_tokens_total", **who) == usage["output_tokens"]

    engine = create_engine(pg_url)
    with engine.connect() as conn:
        num_shards = conn.scalar(
            text("SELECT count(*) FROM shards WHERE batch_id = :b"), {"b": batch_id}
        )
    engine.dispose()
    assert num_shards > 1
    assert moved("model", "batchd_shard_queue_wait_seconds_count", model=MODEL) == num_shards

    # The engine's own figures: one first token and one end per request, and every generated
    # token but each request's first is one inter-token interval.
    assert moved("model", "batchd_engine_time_to_first_token_seconds_count", model=MODEL) == (
        NUM_REQUESTS
    )
    assert moved("model", "batchd_engine_e2e_request_latency_seconds_count", model=MODEL) == (
        NUM_REQUESTS
    )
    generated = moved("model", "batchd_engine_generation_tokens_total", model=MODEL)
    assert generated == usage["output_tokens"]
    assert moved("model", "batchd_engine_inter_token_latency_seconds_count", model=MODEL) == (
        generated - NUM_REQUESTS
    )
    assert (
        moved("model", "batchd_engine_request_success_total", model=MODEL, finished_reason="length")
        == NUM_REQUESTS
    )

    assert moved("control", "batchd_finalize_duration_seconds_count", outcome="completed") == 1
    assert moved("api", "batchd_batches", status="completed") == 1
    assert moved("api", "batchd_uploads_total") == 1
    assert moved("api", "batchd_upload_bytes_total") == len(data)
    assert total(after["api"], "batchd_pending_shards", model=MODEL) == 0

    # No series names the job: ids never become label values.
    custom_ids = {f"m{i:02d}" for i in range(NUM_REQUESTS)}
    for samples in (*after.values(), during["api"], engine_now):
        assert sample_problems(samples, {batch_id, batch()["input_file_id"], *custom_ids}) == []

    # JSON logs: every worker line parses; the batch is followed across both workers.
    for name in ("control", "model"):
        # Celery prints its start banner (and Python a warning) before logging starts.
        lines = procs.log(name).splitlines()
        lines = lines[next(i for i, line in enumerate(lines) if _is_json(line)) :]
        bad = [line for line in lines if line.strip() and not _is_json(line)]
        assert not bad, bad[:20]
        records = [json.loads(line) for line in lines if line.strip()]
        assert all(r.get("level") and r.get("message") is not None for r in records)
        assert records, name
        mine = [r for r in records if r.get("batch_id") == batch_id]
        assert mine, f"no {name} log line carries batch {batch_id}"
    shard_lines = [
        r
        for r in map(json.loads, filter(_is_json, procs.log("model").splitlines()))
        if r.get("batch_id") == batch_id and "shard_id" in r
    ]
    assert shard_lines


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
