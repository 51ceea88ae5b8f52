"""scripts/gpu_check.sh on a machine without a GPU, and the real-size model builder it uses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import real_models

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script")
def test_gpu_check_says_there_is_no_gpu_and_succeeds() -> None:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU here" in proc.stdout
    assert "engine tests" not in proc.stdout  # it ran nothing


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
