"""A simulated model (``sim:``) served by the real stack: the API, a control worker, a model
worker and beat on Postgres and Redis. Its batches complete with the outputs
``engine.sim.simulator`` gives for the same prompt ids (a pure function of them, in any batch and
any process), the service's usage and counters agree with the engine's, and ``/v1/models`` says the
model is simulated."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from core.launch import QUIET, model_worker_command
from testkit.builders.lines import chat_line, create_batch
from testkit.metrics.scrape import scrape, value
from testkit.service.stack import API_KEY, Procs, api_command, stack_env
from testkit.service.stack import celery_command as celery

pytestmark = [pytest.mark.services, pytest.mark.slow]

SIM = "sim-8b"
# Engine options name 4 sequences; the spec's own max_num_seqs wins.
SPEC = "sim:tokens_per_s=2000,max_num_seqs=8,ttft_ms=5,max_model_len=1024"
NUM_REQUESTS = 24


def _lines(order: list[int]) -> bytes:
    return b"".join(
        json.dumps(
            chat_line(f"s{i:02d}", f"simulate request {i} " * (1 + i % 3), 4 + i % 7, model=SIM)
        ).encode()
        + b"\n"
        for i in order
    )


def test_a_sim_model_serves_batches_with_deterministic_outputs(
    pg_url, private_broker, tmp_path, procs: Procs
):
    import httpx

    from core.llms.demo import build
    from engine.sim.simulator import SimEngine
    from engine.text.tokenizer import load_tokenizer

    tokenizer_dir = build("llama-tiny")  # the sim's default tokenizer; built once, here
    model_port, api_port = free_port(), free_port()
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_MODELS=json.dumps({SIM: SPEC}),
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4}),
        BATCHD_CHECKPOINT_EVERY="4",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS="8",
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        BATCHD_WORKER_METRICS_HOST="127.0.0.1",
    )
    procs.start("api", api_command(api_port), env)
    procs.start("control", celery("control", "control", tmp_path), env)
    procs.start("beat", celery("beat", "beat", tmp_path), env)
    model_worker = model_worker_command([SIM], 2, "model@e2e", extra=QUIET)
    procs.start("model", model_worker, {**env, "BATCHD_WORKER_METRICS_PORT": str(model_port)})
    procs.wait_log("model", f"model {SIM} ready: simulated", 120)
    # The control worker loads the tokenizers it validates with at start, not on a first line.
    procs.wait_log("control", f"tokenizers loaded for validation: {SIM}", 120)
    model_metrics = f"http://127.0.0.1:{model_port}/metrics"
    before = scrape(model_metrics)
    assert value(before, "batchd_engine_max_num_seqs", model=SIM) == 8

    client = httpx.Client(
        base_url=f"http://127.0.0.1:{api_port}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    wait_for(lambda: _healthy(client), 60, "the API", procs.logs)
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["owned_by"], m["kind"]) for m in listed] == [
        (SIM, "batchd-sim", "generate")
    ]

    forward = _run_batch(client, _lines(list(range(NUM_REQUESTS))), procs)
    backward = _run_batch(client, _lines(list(reversed(range(NUM_REQUESTS)))), procs)

    # The engine.sim outputs of the same prompt ids, computed here in another process.
    tok = load_tokenizer(str(tokenizer_dir))
    engine = SimEngine(tok, tokens_per_s=1e6, ttft_ms=0, max_model_len=1024)
    from engine import SamplingParams

    input_tokens = output_tokens = 0
    for i in range(NUM_REQUESTS):
        custom_id = f"s{i:02d}"
        line = chat_line(custom_id, f"simulate request {i} " * (1 + i % 3), 4 + i % 7)
        ids = tok.apply_chat_template(
            line["body"]["messages"], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        engine.add_request(custom_id, ids, SamplingParams(max_tokens=4 + i % 7))
        out = next(o for o in _drain(engine) if o.request_id == custom_id).outputs[0]
        for result in (forward, backward):
            body = result[custom_id]["response"]["body"]
            choice = body["choices"][0]
            assert choice["message"]["content"] == out.text
            assert choice["finish_reason"] == "length"
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert body["usage"]["completion_tokens"] == len(out.token_ids) == 4 + i % 7
        input_tokens += len(ids)
        output_tokens += len(out.token_ids)

    # The service's counters and the engine's agree with the usage of both batches.
    after = scrape(model_metrics)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for name, want in [
        ("batchd_prompt_tokens_total", 2 * input_tokens),
        ("batchd_completion_tokens_total", 2 * output_tokens),
        ("batchd_requests_completed_total", 2 * NUM_REQUESTS),
    ]:
        assert moved(name, model=SIM, tenant="default") == want, name
    assert moved("batchd_engine_prompt_tokens_total", model=SIM) == 2 * input_tokens
    assert moved("batchd_engine_generation_tokens_total", model=SIM) == 2 * output_tokens
    assert moved("batchd_engine_time_to_first_token_seconds_count", model=SIM) == 2 * NUM_REQUESTS
    assert moved("batchd_engine_inter_token_latency_seconds_count", model=SIM) == 2 * (
        output_tokens - NUM_REQUESTS
    )
    assert (
        moved("batchd_engine_request_success_total", model=SIM, finished_reason="length")
        == 2 * NUM_REQUESTS
    )
    assert value(after, "batchd_engine_num_requests_running", model=SIM) == 0


def _healthy(client: Any) -> bool:
    import httpx

    try:
        return client.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def _run_batch(client: Any, data: bytes, procs: Procs) -> dict[str, dict[str, Any]]:
    """Upload, create, wait for ``completed``; the output lines by custom_id, after checking
    the batch's usage against them."""
    batch_id = create_batch(client, data)

    def batch() -> dict[str, Any]:
        return client.get(f"/v1/batches/{batch_id}").json()

    wait_for(lambda: batch()["status"] in ("completed", "failed"), 180, "the batch", procs.logs)
    final = batch()
    assert final["status"] == "completed", (final, procs.logs())
    assert final["request_counts"]["completed"] == NUM_REQUESTS
    content = client.get(f"/v1/files/{final['output_file_id']}/content")
    lines = [json.loads(x) for x in content.text.splitlines() if x.strip()]
    assert len(lines) == NUM_REQUESTS
    usage = final["usage"]
    bodies = [line["response"]["body"] for line in lines]
    assert usage["input_tokens"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert usage["output_tokens"] == sum(b["usage"]["completion_tokens"] for b in bodies)
    return {line["custom_id"]: line for line in lines}


def _drain(engine: Any) -> list[Any]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs
