"""The service benchmarks run end to end on a tiny workload and report what they promise.

Each script starts its own API and workers as subprocesses on a fresh Postgres database and a
private Redis, so these are slow smoke tests: they check the scripts work, not the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.model_runner import resolve_device

REPO = Path(__file__).resolve().parents[1]
PG_HOST = os.environ.get("BATCHD_TEST_PG_HOST", "127.0.0.1")
PG_PORT = os.environ.get("BATCHD_TEST_PG_PORT", "5432")
REDIS_HOST = os.environ.get("BATCHD_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = os.environ.get("BATCHD_TEST_REDIS_PORT", "6379")
SERVERS = [
    "--pg-admin-url",
    f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/postgres",
    "--redis-url",
    f"redis://{REDIS_HOST}:{REDIS_PORT}/0",
]

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _run(module: str, *args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args, *SERVERS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_bench_service_runs_the_same_batch_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "service.json"
    proc = _run(
        "service", "--model-preset", "llama-tiny", "--requests", "24",
        "--shard-requests", "6", "--max-tokens", "lognormal:6:0.7",
        "--prompt-words", "lognormal:8:0.7", "--warmup", "2",
        "--stats-interval", "0.1", "--json", str(out),
    )  # fmt: skip
    data = json.loads(out.read_text())
    engine, service = data["engine"], data["service"]
    assert service["status"] == "completed"
    assert engine["requests"] == service["requests"] == 24
    assert engine["errors"] == service["errors"] == 0
    # Greedy: the same requests give the same number of output tokens both ways.
    assert service["output_tokens"] == engine["output_tokens"] > 0
    assert data["same_output_token_counts"] == 24
    assert data["shards"] == 4
    assert data["throughput_ratio"] > 0
    assert service["e2e_seconds"] >= service["batch_seconds"] > 0
    occ = data["occupancy"]
    # The engine's default for the device the benchmark ran on.
    default_seqs = EngineConfig().for_device(resolve_device("auto").type).max_num_seqs
    assert occ["samples"] >= 2 and occ["max_num_seqs"] == default_seqs
    assert 0.0 <= occ["occupancy_whole_run"] <= 1.0
    assert "throughput ratio" in proc.stdout and "occupancy while backlogged" in proc.stdout


def test_bench_upload_memory_reports_both_processes(tmp_path: Path) -> None:
    out = tmp_path / "upload.json"
    proc = _run(
        "upload_memory", "--model-preset", "llama-tiny", "--requests", "300",
        "--line-bytes", "1000", "--json", str(out),
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["status"] == "in_progress" and data["requests"] == 300
    assert 250_000 < data["file_bytes"] < 350_000
    assert data["processes"].keys() == {"api", "control"}
    for figures in data["processes"].values():
        assert figures["base_rss_mb"] > 0 and figures["end_hwm_mb"] >= figures["peak_rss_mb"] > 0
        assert figures["pass"]
    assert data["pass"] and "PASS" in proc.stdout


@pytest.mark.parametrize("unfinished", ["0", "0.5"])
def test_finalize_scale_finalizes_what_it_builds(tmp_path: Path, unfinished: str) -> None:
    out = tmp_path / "finalize.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.finalize_scale", "--sizes", "200,400",
         "--unfinished", unfinished, "--json", str(out), *SERVERS[:2]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    rows = figures["sizes"]
    assert [r["lines"] for r in rows] == [200, 400]
    assert {r["status"] for r in rows} == {"cancelled" if unfinished != "0" else "completed"}
