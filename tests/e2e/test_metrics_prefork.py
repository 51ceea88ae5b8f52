"""A worker that forks its pool (Celery's prefork) exports its children's counters: with
``PROMETHEUS_MULTIPROC_DIR`` set, the exporter of the parent process sums what every child
counted. Here a child validates a batch over the tenant's enqueued-token limit, and the
parent's exporter reports the refusal."""

from __future__ import annotations

import json

import pytest

from cli.perf.service import free_port, wait_for
from core.launch import QUIET, control_worker_command
from testkit.builders.lines import chat_line, create_batch
from testkit.metrics.scrape import scrape, value
from testkit.service.stack import API_KEY, Procs, api_command, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_prefork_children_are_counted(pg_url, private_broker, tmp_path, procs: Procs):
    import httpx

    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    port, metrics_port = free_port(), free_port()
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_MAX_ENQUEUED_TOKENS_PER_TENANT="1",
        BATCHD_WORKER_METRICS_PORT=str(metrics_port),
        BATCHD_WORKER_METRICS_HOST="127.0.0.1",
        PROMETHEUS_MULTIPROC_DIR=str(multiproc),
    )
    procs.start("api", api_command(port), env)
    control = control_worker_command("control@e2e", pool="prefork", extra=QUIET)
    procs.start("control", control, env)
    procs.wait_log("control", "ready.", 60)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    wait_for(lambda: _up(url), 30, "the exporter", procs.logs)
    before = value(scrape(url), "batchd_rejections_total", reason="token_limit_exceeded")

    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    data = json.dumps(chat_line("only", "too many tokens for this tenant")).encode() + b"\n"
    batch_id = create_batch(client, data)
    wait_for(
        lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "failed",
        60,
        "the batch to fail validation",
        tmp_path,
    )
    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["errors"]["data"][0]["code"] == "token_limit_exceeded"
    after = value(scrape(url), "batchd_rejections_total", reason="token_limit_exceeded")
    assert after - before == 1
    assert any(multiproc.iterdir()), "the children wrote no metric files"


def _up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
