"""``batchd bench`` against an embedded service (API, control worker, model worker on real
Postgres and Redis) with a tiny scheduled workload: every metric of the report has its
percentiles, and the request counts are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.perf.bench import DISTRIBUTIONS

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_bench_embedded_service_reports_every_metric(
    pg_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings

    monkeypatch.delenv("BATCHD_MODELS", raising=False)  # --model names the demo preset
    monkeypatch.setenv("BATCHD_ENGINE_OPTIONS", "{}")
    get_settings.cache_clear()
    schedule = tmp_path / "schedule.jsonl"
    jobs = [
        {"at": 0.0, "requests": 5, "tenant": "acme", "priority": "normal"},
        {"at": 0.3, "requests": 3, "tenant": "globex", "priority": "high"},
        {"at": 0.6, "requests": 4, "tenant": "acme", "priority": "low"},
        # An unknown priority: the API refuses the batch, so its 2 requests are rejected.
        {"at": 0.9, "requests": 2, "tenant": "globex", "priority": "urgent"},
    ]
    schedule.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    out = tmp_path / "bench"
    try:
        result = CliRunner().invoke(
            app,
            [
                "bench", "--model", "demo:llama-tiny", "--database-url", pg_url,
                "--broker-url", redis_url,
                "--schedule", str(schedule), "--input-len", "uniform:8:24",
                "--output-len", "uniform:3:8", "--shard-requests", "2",
                "--interval", "0.2", "--poll", "0.2", "--out", str(out),
            ],
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    for name in ("latency.png", "timeline.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    dist = data["distributions"]
    assert set(dist) == set(DISTRIBUTIONS)
    for name, s in dist.items():
        assert s["n"] > 0, name
        assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"], name
    assert dist["ttft_s"]["n"] == dist["request_e2e_s"]["n"] == 12
    assert dist["job_e2e_s"]["n"] == dist["batch_queue_s"]["n"] == 3
    assert dist["shard_queue_s"]["n"] == 3 + 2 + 2  # shards of at most 2 requests
    assert 0 < dist["engine_occupancy"]["max"] <= 1
    assert {"api", "control", "model"} <= set(data["rss_mb"])
    for name in ("api", "control", "model"):
        assert data["rss_mb"][name]["p50"] > 0 and data["peak_rss_mb"][name] > 0

    counts = data["counts"]
    assert counts["jobs"] == {"submitted": 4, "completed": 3, "rejected": 1, "other": {}}
    assert counts["requests"] == {
        "submitted": 14,
        "completed": 12,
        "failed": 0,
        "rejected": 2,
        "unaccounted": 0,
        "error_codes": {},
    }
    assert counts["timing_records"] == 12
    rejected = [j for j in data["jobs"] if j["rejected"]]
    assert [j["index"] for j in rejected] == [3] and rejected[0]["rejected"].startswith("HTTP 4")
    assert data["totals"]["output_tokens"] > 0
    assert "TTFT" in result.output and "engine occupancy" in result.output
