"""``batchd bench --url`` against a service already running (the API, a control worker and a
model worker as subprocesses on real Postgres and a private Redis, serving the tiny demo
model): the report counts exactly the requests it sent, and its latencies are real ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL
from testkit.service.stack import (
    API_KEY,
    Procs,
    api_command,
    celery_command,
    private_redis,
    stack_env,
)

pytestmark = [pytest.mark.services, pytest.mark.slow]

JOBS, PER_JOB, OUTPUT_TOKENS = 2, 2, 3


@pytest.fixture
def running(pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, str, Procs]]:
    """(the API's base URL, the broker URL, its processes) of a service started here."""
    from cli.perf.service import api_up
    from core.llms.demo import build

    build("llama-tiny")  # once, before two processes race to build it
    root = tmp_path / "service"
    root.mkdir()
    with private_redis(redis_url, root) as broker:
        port = free_port()
        env = stack_env(pg_url, broker, root)
        procs = Procs(root)
        try:
            procs.start("api", api_command(port), env)
            procs.start("control", celery_command("control", "control", root), env)
            procs.start("model", celery_command("model", "model", root), env)

            def ready() -> bool:
                procs.check_alive()
                return (
                    api_up(port)
                    and "ready." in procs.log("control")
                    and f"model {MODEL} ready" in procs.log("model")
                )

            wait_for(ready, 120, "the API, the workers and the model", procs.logs)
            yield f"http://127.0.0.1:{port}/v1", broker, procs
        finally:
            procs.stop_all(grace_s=10)


def test_bench_a_running_service(
    running: tuple[str, str, Procs], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings

    base_url, broker, procs = running
    # The client's own settings name no model: the service's /v1/models does.
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({"not-served-here": "demo:llama-tiny"}))
    get_settings.cache_clear()
    out = tmp_path / "bench"
    try:
        result = CliRunner().invoke(
            app,
            [
                "bench", "--url", base_url, "--api-key", API_KEY, "--broker-url", broker,
                "--jobs", str(JOBS), "--rate", "0", "--requests-per-job", f"fixed:{PER_JOB}",
                "--input-len", "fixed:8", "--output-len", f"fixed:{OUTPUT_TOKENS}",
                "--interval", "0.2", "--poll", "0.2", "--out", str(out),
            ],
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["service"] == base_url and data["settings"]["model"] == MODEL

    sent = JOBS * PER_JOB
    counts = data["counts"]
    why = [(job["status"], job["rejected"]) for job in data["jobs"]]  # named if it fails
    why += [line for line in procs.log("api").splitlines() if "ERROR" in line or "Error" in line]
    assert counts["jobs"] == {"submitted": JOBS, "completed": JOBS, "rejected": 0, "other": {}}, why
    assert counts["requests"] == {
        "submitted": sent,
        "completed": sent,
        "failed": 0,
        "rejected": 0,
        "unaccounted": 0,
        "error_codes": {},
    }
    assert counts["timing_records"] == sent
    assert data["totals"]["output_tokens"] == sent * OUTPUT_TOKENS

    dist = data["distributions"]
    for name in ("ttft_s", "itl_s", "request_e2e_s"):
        assert dist[name]["n"] == sent, name
    assert dist["job_e2e_s"]["n"] == dist["batch_queue_s"]["n"] == JOBS
    for name in ("ttft_s", "itl_s", "request_e2e_s", "job_e2e_s", "batch_queue_s"):
        s = dist[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"] < 120, (name, s)
    # A request ends after its first token, and its job after the request.
    assert dist["ttft_s"]["max"] <= dist["request_e2e_s"]["max"] <= dist["job_e2e_s"]["max"]
    assert "TTFT" in result.output

    # A run that measured nothing (every job refused: a model the service does not serve) is
    # an error, not a report a pipeline could read as a pass.
    refused = CliRunner().invoke(
        app,
        [
            "bench", "--url", base_url, "--api-key", API_KEY, "--model", "not-served-here",
            "--jobs", "1", "--rate", "0", "--requests-per-job", "fixed:1",
            "--input-len", "fixed:4", "--output-len", "fixed:1", "--poll", "0.2",
            "--out", str(tmp_path / "refused"),
        ],
    )  # fmt: skip
    assert refused.exit_code == 1, refused.output
    assert "none of the 1 jobs completed" in refused.output
    assert (
        json.loads((tmp_path / "refused" / "bench.json").read_text())["counts"]["jobs"]["rejected"]
        == 1
    )
