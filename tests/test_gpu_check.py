"""scripts/gpu_check.sh and scripts/gpu_wheels.sh on a machine without a GPU: the no-GPU path,
the time budget, the report under $OUT, the wheels' size guard, a rehearsal of every step on
the CPU; and the real-size model builder the check uses."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import real_models

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"


def run(script: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **env},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script")
def test_gpu_check_says_there_is_no_gpu_and_succeeds(tmp_path: Path) -> None:
    proc = run(CHECK, OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU here" in proc.stdout
    assert "engine tests" not in proc.stdout  # it ran nothing
    # The log is written where the device tool collects files ($OUT), and says the same.
    assert "no CUDA GPU here" in (tmp_path / "gpu_check.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.log"]


def test_gpu_check_time_limits_add_up_to_under_8_minutes() -> None:
    proc = run(CHECK, "--budget")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"budget: (\w+) +(\d+) x \( *(\d+) s \+ +(\d+) s grace\)", proc.stdout)
    assert {name for name, *_ in steps} >= {"probe", "install", "tests", "build", "bench"}
    total = sum(int(n) * (int(limit) + int(grace)) for _, n, limit, grace in steps)
    assert f"total {total} s of 480 s" in proc.stdout
    assert total <= 480


def test_every_python_the_gpu_check_starts_runs_under_a_time_limit() -> None:
    """By construction: no step of the check can run longer than its share of the budget."""
    script = CHECK.read_text()
    calls = [ln for ln in script.splitlines() if re.search(r'"\$PY" [-"]', ln)]
    assert len(calls) >= 8
    for line in calls:
        assert re.search(r"timeout (-s INT )?-k \S+ \S+ .*\$PY", line), line
    # The budget counts each step as often as it runs: the module look-ups three times (the
    # needed ones before and after the install, the model packages), the probes twice.
    assert script.count("$(missing ") == 3 and "deps 3 $T_DEPS" in script
    assert "probe 2 $T_PROBE" in script


def fake_wheel(directory: Path, name: str, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / name, "wb") as f:
        f.truncate(size)  # sparse: the apparent size is what the guard sums


def test_wheels_guard_prints_the_total_and_passes_within_64_mib(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "pytest-9.2.0-py3-none-any.whl", 40 * 2**20)
    fake_wheel(tmp_path, "llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl", 24 * 2**20)
    proc = run(WHEELS, "--check", GPU_WHEELS_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "2 wheels" in proc.stdout and "64.00 MiB together (limit 64 MiB)" in proc.stdout


def test_wheels_guard_fails_over_64_mib(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "pytest-9.2.0-py3-none-any.whl", 40 * 2**20)
    fake_wheel(tmp_path, "llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl", 24 * 2**20 + 1)
    proc = run(WHEELS, "--check", GPU_WHEELS_DIR=str(tmp_path))
    assert proc.returncode == 1
    assert "64.00 MiB together" in proc.stdout  # rounded down, still over
    assert "over the 64 MiB limit" in proc.stderr


def test_wheels_guard_refuses_two_versions_of_one_package_and_an_empty_dir(
    tmp_path: Path,
) -> None:
    fake_wheel(tmp_path, "pytest-9.2.0-py3-none-any.whl", 1000)
    fake_wheel(tmp_path, "pytest-8.4.0-py3-none-any.whl", 1000)
    proc = run(WHEELS, "--check", GPU_WHEELS_DIR=str(tmp_path))
    assert proc.returncode == 1 and "more than one wheel of: pytest" in proc.stderr
    proc = run(WHEELS, "--check", GPU_WHEELS_DIR=str(tmp_path / "none"))
    assert proc.returncode == 1 and "no wheels" in proc.stderr


def test_wheels_list_names_each_package_once_with_a_pinned_version() -> None:
    block = WHEELS.read_text().split("PACKAGES=(", 1)[1].split("\n)", 1)[0]
    pins = [w for ln in block.splitlines() for w in ln.split("#")[0].split()]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][\w.]*", p) for p in pins), pins
    names = [p.split("==")[0] for p in pins]
    assert len(names) == len(set(names))
    # What the image already holds never travels: it would shadow the image's own build.
    assert not {"torch", "transformers", "numpy", "tokenizers", "safetensors"} & set(names)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script")
def test_gpu_check_rehearsal_on_the_cpu_writes_its_report_under_out(tmp_path: Path) -> None:
    """Every step on the CPU: tiny shapes, one fast test module, a few requests. The report
    lands in $OUT, and docs/gpu.md is left alone (only a GPU run appends to it)."""
    docs = (ROOT / "docs" / "gpu.md").read_text()
    proc = run(
        CHECK,
        timeout=400,
        OUT=str(tmp_path),
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_TESTS="tests/engine/core/test_block_manager.py",
        GPU_CHECK_REQUESTS="4",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rehearsal on the CPU" in proc.stdout
    assert "engine tests on cpu: exit 0" in proc.stdout
    names = {p.name for p in tmp_path.iterdir()}
    assert {"gpu_check.log", "gpu.md"} <= names
    for model in real_models.SHAPES:
        data = json.loads((tmp_path / f"{model}.json").read_text())
        assert data["device"] == "cpu" and data["systems"]["engine"]["output_tok_s"] > 0
    section = (tmp_path / "gpu.md").read_text()
    assert section.startswith("### ") and "transformers " in section
    assert "- engine tests: exit 0 (" in section and "passed" in section
    assert all(f"- {model} (float32 on cpu): engine " in section for model in real_models.SHAPES)
    assert (tmp_path / "gpu_check.log").read_text().count("== ") == 4  # steps 0 to 3
    assert (ROOT / "docs" / "gpu.md").read_text() == docs
    assert len(names) <= 8  # what the device tool brings back


@pytest.mark.parametrize("name", sorted(real_models.SHAPES))
def test_real_size_shapes_have_the_published_parameter_count(name: str) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(real_models.real_config(name))
    assert sum(p.numel() for p in model.parameters()) == real_models.PARAMETERS[name]


def test_real_size_builder_at_a_tiny_scale_gives_a_model_the_engine_runs(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine import LLM, SamplingParams

    tiny = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 512,
    }
    path = real_models.build("qwen2-0.5b", tmp_path, dtype="float32", **tiny)
    assert real_models.build("qwen2-0.5b", tmp_path, dtype="float32", **tiny) == path  # cached
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6
    assert (config.hidden_size, config.vocab_size) == (64, 4096)
    with pytest.raises(ValueError, match="unknown real-size model"):
        real_models.build("gpt-9", tmp_path)

    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32)
    prompt = llm.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    out = (
        llm.generate(
            [prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ref = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        min_new_tokens=5,
    )[0, len(prompt) :].tolist()
    assert list(out) == ref
