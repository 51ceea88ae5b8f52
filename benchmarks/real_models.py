"""Random-init models of real size, for benchmarks on a GPU.

No machine here can download weights, but throughput depends on shapes, not on trained
values: a model with the layer count, widths, head layout and vocabulary of Qwen2-0.5B or
Llama-3.2-1B costs what they cost per token. The weights are a seeded random init in the
target dtype; the tokenizer is the project's locally trained one (the demo models'), whose ids
are a subset of the model's vocabulary; the output layer keeps the full vocabulary, so
the logits cost what they cost in the real model.

    python -m benchmarks.real_models qwen2-0.5b llama-3.2-1b   # build, print the directories
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# The published configurations' shapes (config.json of each model), nothing else.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
}
# Published parameter counts, for the test that the shapes are right.
PARAMETERS = {"qwen2-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}
BUILD_VERSION = 1


def real_config(name: str, **overrides: Any) -> Any:
    """The transformers config of ``name``; ``overrides`` shrink it (tests build it tiny)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown real-size model {name!r}; choose one of {sorted(SHAPES)}")
    fields = {**SHAPES[name], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build(
    name: str,
    root: Path | None = None,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Return the directory of ``name`` (built on first use under ``root``, default the demo
    models' cache). ``device`` is where the random init runs (a GPU inits a 1B model in a
    second; the CPU takes a minute)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from core.llms.demo import build as build_demo
    from core.llms.demo import cache_root

    suffix = "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) if overrides else ""
    root = Path(root) if root else cache_root()
    target = root / f"{name}{suffix}-{dtype}-v{BUILD_VERSION}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(build_demo("llama-tiny"))
    config = real_config(name, **overrides)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"vocab_size {config.vocab_size} is below the tokenizer's {len(tokenizer)}"
        )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in argv or sorted(SHAPES):
        print(build(name, device=device))


if __name__ == "__main__":
    main(sys.argv[1:])
