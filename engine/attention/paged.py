"""Paged attention, registered with transformers' attention interface as ``batchd_paged``.

A step's tokens are packed into one flat sequence (batch 1, no padding). :func:`paged_attention`
gets an :class:`AttentionContext` as the ``batchd_ctx`` forward kwarg, writes the new K/V into
the layer's cache (``[kv_heads, num_blocks, block_size, head_dim]``) at ``slot_mapping``, and
hands the step to the backend: ``sdpa`` on CPU, ``flex`` on CUDA. Every backend honours
``sliding_window`` and ``softcap``; any other keyword is refused by name, never dropped. No
attention mask is built over the packed sequence. See docs/engine-step.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

ATTENTION_NAME = "batchd_paged"
BACKENDS = ("sdpa", "flex")

# Keywords a model may pass that change nothing here: they are None/False/0 for inference,
# or describe masks and caches that the paged context replaces.
_INERT_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "is_causal",
        "past_key_values",
        "past_key_value",
        "cache",
    }
)
# Config attributes of attention features no backend implements: such a model is refused at load.
_UNSUPPORTED_CONFIG = {
    "attention_chunk_size": "chunked local attention (attention_chunk_size)",
    "use_bidirectional_attention": "bidirectional attention (use_bidirectional_attention)",
}


@dataclass(slots=True)
class PrefillChunk:
    start: int  # offsets of the chunk in the packed sequence
    end: int
    context_len: int = 0  # cached + new tokens; 0 when the chunk starts the sequence
    blocks: torch.Tensor | None = None  # the sequence's block ids covering the context
    first_pos: int = 0  # position of the chunk's first token in its sequence
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # by window


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows ``start .. end`` of the packed sequence (one query per sequence), sequences
    of similar length attended together: ``blocks`` holds each one's block ids padded to the
    longest (with the scratch block), ``lens`` their context lengths (the new token included),
    ``context_lens`` the same as Python ints."""

    start: int
    end: int
    blocks: torch.Tensor  # [n, max_blocks] long
    lens: torch.Tensor  # [n] long
    block_size: int
    context_lens: list[int] = field(default_factory=list)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [n, keys] by window

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, max_blocks * block_size] bool, True where a sequence attends the key."""
        if window not in self.masks:
            keys = self.blocks.shape[1] * self.block_size
            pos = torch.arange(keys, device=self.lens.device).unsqueeze(0)
            lens = self.lens.unsqueeze(1)
            mask = pos < lens
            if window is not None:
                mask &= pos >= lens - window
            self.masks[window] = mask
        return self.masks[window]


@dataclass(slots=True)
class FlexStep:
    """The packed step as FlexAttention sees it: query row -> (sequence, position), and for
    each sequence the logical index of every physical block it owns (-1 where it owns none)."""

    q_seq: torch.Tensor  # [num_tokens] int32
    q_pos: torch.Tensor  # [num_tokens] int32
    block_to_logical: torch.Tensor  # [num_seqs, num_blocks] int32
    block_size: int
    masks: dict[int | None, Any] = field(default_factory=dict)  # BlockMask by window


class Backend(Protocol):
    name: str

    def attend(
        self,
        ctx: AttentionContext,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """``query`` [1, H, T, D], ``key``/``value`` [1, KV, T, D]; return [T, H, D]."""
        ...


@dataclass(slots=True)
class AttentionContext:
    """Everything the attention layers need for one step; built once, read by every layer."""

    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every packed token
    backend: Backend | None = None
    decodes: list[DecodeGroup] = field(default_factory=list)  # the packed sequence starts with them
    prefills: list[PrefillChunk] = field(default_factory=list)
    flex: FlexStep | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchd_ctx: AttentionContext | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    ctx = batchd_ctx
    if ctx is None or ctx.backend is None:
        raise RuntimeError("batchd_paged attention needs the batchd_ctx forward kwarg")
    check_kwargs(kwargs)
    if dropout:
        raise ValueError(f"batchd_paged attention runs inference only; got dropout={dropout}")
    layer = module.layer_idx
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    kv_heads, head_dim = key.shape[1], key.shape[3]
    slots = ctx.slot_mapping
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, key[0].to(k_cache.dtype))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, value[0].to(v_cache.dtype))
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    out = ctx.backend.attend(ctx, layer, query, key, value, scaling, window, cap)
    return out.unsqueeze(0), None


def check_kwargs(kwargs: dict[str, object]) -> None:
    """Refuse an attention keyword this engine does not implement instead of ignoring it."""
    for name, value in kwargs.items():
        if name in _INERT_KWARGS:
            if name == "output_attentions" and value:
                raise ValueError("batchd_paged attention cannot return attention weights")
            if name == "is_causal" and value is False:
                raise ValueError(
                    "the model asks for non-causal attention (is_causal=False), "
                    "which the batchd_paged attention backends do not implement"
                )
            continue
        if value is None or value is False:
            continue
        raise ValueError(
            f"the model passes the attention argument {name!r} ({type(value).__name__}), "
            f"which the batchd_paged attention backends do not implement; refusing the model "
            f"rather than ignoring it"
        )


def check_config(config: Any) -> None:
    """Refuse at load a model whose config asks for an attention feature no backend has."""
    for attr, feature in _UNSUPPORTED_CONFIG.items():
        if getattr(config, attr, None):
            raise ValueError(
                f"the model uses {feature}, which batchd's attention backends do not implement"
            )


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name not in BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {list(BACKENDS)}, got {name!r}"
        )
    return name


def register() -> str:
    """Register the attention function with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
