"""The packed inputs of one engine step, run eagerly or through a captured CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.paged import AttentionContext
from engine.core.sequence import Sequence
from engine.lora.layers import LoraStep


@dataclass(slots=True)
class StepBatch:
    """The packed inputs of one step and which sequences get a sampled token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    sample_rows: torch.Tensor  # rows of the packed sequence whose logits are sampled
    sample_seqs: list[Sequence]
    num_tokens: int
    lora: LoraStep | None = None  # the rows of each adapter, if any row has one
