"""``batchd tune`` on the tiny model with a tiny grid: the options file it writes is what
``BATCHD_ENGINE_OPTIONS`` reads, and the chosen point is the best one it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.slow


def test_tune_writes_the_best_measured_point_as_engine_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import Settings, get_settings
    from engine.core.config import EngineConfig

    out = tmp_path / "engine-options.json"
    result = CliRunner().invoke(
        app,
        [
            "tune", "--model", "demo:llama-tiny", "--requests", "24",
            "--input-len", "uniform:8:40", "--output-len", "uniform:4:16",
            "--max-num-seqs", "1,4,16", "--max-num-batched-tokens", "64,512",
            "--kv-memory", "8MiB", "--engine-options", '{"max_model_len": 256}',
            "--warmup", "2", "--measure", "0.2", "--min-steps", "3", "--threads", "1",
            "-o", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    options = json.loads(out.read_text())
    report = json.loads((tmp_path / "tune.json").read_text())
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Loads as engine options, directly and through the BATCHD_ENGINE_OPTIONS setting.
    EngineConfig.from_kwargs(**options)
    monkeypatch.setenv("BATCHD_ENGINE_OPTIONS", out.read_text())
    get_settings.cache_clear()
    try:
        assert Settings().engine_options == options
    finally:
        get_settings.cache_clear()
    assert options["kv_cache_memory"] == 8 << 20 and options["max_model_len"] == 256

    # Every grid point ran, the 3 best 3 more times each (4 windows); the chosen one is the
    # best by the objective.
    points = report["points"]
    assert len(points) == 6 and all(p["error"] is None and p["steps"] >= 3 for p in points)
    assert sorted(p["runs"] for p in points) == [1, 1, 1, 4, 4, 4]
    candidates = [p for p in points if not p["kv_bound"]] or points  # KV-bound: left out
    best = max(candidates, key=lambda p: p["output_tok_s"])
    chosen = report["chosen"]
    assert chosen["output_tok_s"] == best["output_tok_s"]
    assert (options["max_num_seqs"], options["max_num_batched_tokens"]) == (
        best["max_num_seqs"],
        best["max_num_batched_tokens"],
    )
    assert report["engine_options"] == options
    assert report["clock"] == "cpu"
    assert set(report["saturation"]) >= {"kv_memory", "compute"}


def test_tune_search_respects_a_step_time_limit(tmp_path: Path) -> None:
    out = tmp_path / "opts.json"
    result = CliRunner().invoke(
        app,
        [
            "tune", "--model", "demo:llama-tiny", "--requests", "16",
            "--input-len", "fixed:16", "--output-len", "fixed:8", "--max-seqs", "8",
            "--kv-memory", "8MiB", "--engine-options", '{"max_model_len": 128}',
            "--warmup", "1", "--measure", "0.1", "--min-steps", "2", "--threads", "1",
            "--max-step-ms", "1e9", "-o", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "tune.json").read_text())
    seqs = {p["max_num_seqs"] for p in report["points"]}
    assert {1, 2, 4} <= seqs  # the doubling curve, then the search around the best
    tokens = {p["max_num_batched_tokens"] for p in report["points"]}
    assert len(tokens) > 1
    chosen = report["chosen"]
    candidates = [p for p in report["points"] if not p["kv_bound"]] or report["points"]
    assert chosen["output_tok_s"] == max(p["output_tok_s"] for p in candidates)
