"""The CUDA attention backend: one FlexAttention call per layer over the whole packed step.

Keys and values are the layer's whole paged cache seen in place as ``[1, KV, num_slots, D]``;
a mask function lets a query row attend a cache slot when the slot's block is one of the row's
sequence's, the key is not after the query, and (sliding-window layers) within the window.
Decodes and prefill chunks are rows of the same call; the block mask is built once per step
and window. Compiled on CUDA; on CPU it runs uncompiled (correct, slow: for the tests).
The mask in full: docs/engine-step.md ("The flex mask").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from engine.attention.paged import AttentionContext, FlexStep


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory and a non-blocking copy,
    so preparing a step never waits for the GPU to finish the previous one."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def build_step(
    tables: list[list[int]],
    token_seqs: list[int],
    positions: torch.Tensor,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> FlexStep:
    """A fixed number of tensor ops, whatever the number of sequences: the block tables are
    padded to one ``[num_seqs, width]`` tensor (padding points at a spare column) and scattered
    into the per-sequence block -> logical index map."""
    width = max(len(t) for t in tables)
    padded = [t + [num_blocks] * (width - len(t)) for t in tables]
    table = to_device(padded, torch.long, device)
    logical = torch.arange(width, dtype=torch.int32, device=device).expand(len(tables), width)
    block_to_logical = torch.full(
        (len(tables), num_blocks + 1), -1, dtype=torch.int32, device=device
    )
    block_to_logical.scatter_(1, table, logical)
    return FlexStep(
        q_seq=to_device(token_seqs, torch.int32, device),
        q_pos=positions.to(torch.int32),
        block_to_logical=block_to_logical,
        block_size=block_size,
    )


def mask_mod_for(step: FlexStep, window: int | None) -> Any:
    q_seq, q_pos, b2l, bs = step.q_seq, step.q_pos, step.block_to_logical, step.block_size

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical = b2l[q_seq[q_idx], kv_idx // bs]
        kv_pos = logical * bs + kv_idx % bs
        qp = q_pos[q_idx]
        ok = (logical >= 0) & (kv_pos <= qp)
        if window is not None:
            ok = ok & (kv_pos > qp - window)
        return ok

    return mask_mod


def block_mask(
    step: FlexStep, window: int | None, num_slots: int, device: torch.device
) -> BlockMask:
    if window not in step.masks:
        num_tokens = step.q_seq.shape[0]
        # On CUDA the mask is built by a compiled function (no dense [tokens, slots] tensor).
        step.masks[window] = create_block_mask(
            mask_mod_for(step, window),
            B=None,
            H=None,
            Q_LEN=num_tokens,
            KV_LEN=num_slots,
            device=device,
            _compile=device.type == "cuda",
        )
    return step.masks[window]


def _softcap_mod(softcap: float) -> Any:
    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.tanh(score / softcap) * softcap

    return score_mod


_compiled: Any = None


def _kernel(device: torch.device) -> Any:
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        # Default (automatic) dynamic shapes: the step's token count changes every step, and a
        # static compile would recompile for each new count.
        _compiled = torch.compile(flex_attention)
    return _compiled


class FlexBackend:
    name = "flex"

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
        step = ctx.flex
        if step is None:
            raise RuntimeError("the flex attention backend needs a FlexStep in the context")
        k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
        num_heads, head_dim = query.shape[1], query.shape[3]
        kv_heads = key.shape[1]
        num_slots = k_cache.shape[1] * k_cache.shape[2]
        k = k_cache.view(1, kv_heads, num_slots, head_dim)  # [1, KV, S, D] in place
        v = v_cache.view(1, kv_heads, num_slots, head_dim)
        out = _kernel(query.device)(
            query.to(k.dtype),
            k,
            v,
            score_mod=None if softcap is None else _softcap_mod(softcap),
            block_mask=block_mask(step, window, num_slots, query.device),
            scale=scaling,
            enable_gqa=num_heads > kv_heads,
        )
        return out[0].transpose(0, 1).to(query.dtype)  # [T, H, D]
