"""LoRA adapters for tests, made here: peft's own directory format (``adapter_config.json`` and
``adapter_model.safetensors``) over a local base model, with seeded random A and B.

peft initialises B to zero (an adapter that changes nothing); these set both A and B from a
seeded generator, scaled so that the adapter really changes the model's greedy output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def make_adapter(
    base_model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    target_modules: Sequence[str],
    seed: int,
    alpha: float | None = None,
    std: float = 0.3,
) -> Path:
    """Write a LoRA adapter of ``rank`` over ``target_modules`` (e.g. ``["q_proj", "v_proj"]``)
    of the model in ``base_model_dir`` to ``out_dir`` and return ``out_dir``.

    ``alpha`` defaults to ``2 * rank`` (a scale of 2). A and B are drawn from a generator
    seeded with ``seed``: A with a standard deviation of ``1/sqrt(in_features)``, B of
    ``std/sqrt(rank)``, so the delta's size is about ``std`` times the input's, whatever the
    rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, module in sorted(model.named_modules(), key=lambda item: item[0]):
            lora_a = getattr(module, "lora_A", None)
            if not isinstance(lora_a, torch.nn.ModuleDict) or "default" not in lora_a:
                continue
            a = lora_a["default"].weight
            b = module.lora_B["default"].weight  # type: ignore[index,union-attr]
            a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=gen) * std / rank**0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out
