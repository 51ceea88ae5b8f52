"""The forward of a Llama decoder stack on a CPU without transformers' per-layer Python.

The operators of transformers' ``LlamaModel`` forward, in its order (so the same numbers), from
one loop: no module hooks, keyword plumbing or deprecation wrappers a layer, q/k/v and gate/up
through the fused projections (engine/forward/fusion.py), attention straight to the paged function.
In float32 and bf16, where the compiled layer ops build (engine/cpu/kernels.py), the work
between the matmuls is one call each: the residual add with the next norm, rotary embedding with the K/V
cache write, SiLU with the gate/up product. Only where every part is transformers' own Llama
class; any other model keeps its forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.paged import AttentionContext, paged_attention
from engine.cpu.kernels import LayerOps, layer_ops
from engine.forward.fusion import FusedLinear

log = logging.getLogger("engine")

_CLASSES = {
    "model": "LlamaModel",
    "layer": "LlamaDecoderLayer",
    "attention": "LlamaAttention",
    "mlp": "LlamaMLP",
    "norm": "LlamaRMSNorm",
    "rotary": "LlamaRotaryEmbedding",
}


@dataclass(slots=True)
class _Layer:
    """One layer's parts; the linear layers as their ``forward`` functions, called without
    ``nn.Module.__call__`` (no hooks are set on them): a step calls four of them a layer."""

    attention: torch.nn.Module  # read by the paged function (its layer_idx)
    index: int  # the layer's KV cache
    norm_in: torch.nn.Module
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    norm_post: torch.nn.Module
    post: tuple[torch.Tensor, float]  # norm_post's weight and epsilon
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    act: Any
    down: Callable[[torch.Tensor], torch.Tensor]
    scaling: float


class LeanLlama:
    """``base``'s forward over a packed step: embeddings, every layer, the final norm."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.base = base
        config = base.config
        head_dim = int(base.layers[0].self_attn.head_dim)
        fusable = (
            base.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16)
            and getattr(config, "hidden_act", None) == "silu"
            and type(getattr(base, "rotary_emb", None)).__name__ == _CLASSES["rotary"]
        )
        if fusable and not LayerOps.takes_head_dim(head_dim):
            log.info("head_dim %d: the compiled layer ops do not take it, torch's kept", head_dim)
            fusable = False
        self.ops: LayerOps | None = layer_ops() if fusable else None
        self.layers = [
            _Layer(
                layer.self_attn,
                int(layer.self_attn.layer_idx),
                layer.input_layernorm,
                layer.self_attn.fused_q_k_v.linear.forward,
                layer.self_attn.o_proj.forward,
                layer.post_attention_layernorm,
                _norm(layer.post_attention_layernorm),
                layer.mlp.fused_gate_up.linear.forward,
                layer.mlp.act_fn,
                layer.mlp.down_proj.forward,
                float(layer.self_attn.scaling),
            )
            for layer in base.layers[: base.config.num_hidden_layers]
        ]
        attention = base.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.q_end, self.k_end = (end for _, end in attention.fused_q_k_v.bounds[:2])
        self.inner = base.layers[0].mlp.fused_gate_up.bounds[0][1]
        # Each layer's input norm, then the final one: the norm after layer i is norms[i + 1].
        self.norms = [_norm(layer.norm_in) for layer in self.layers] + [_norm(base.norm)]

    @classmethod
    def of(cls, base: torch.nn.Module) -> LeanLlama | None:
        """The lean forward of ``base``, or None where it is not exactly a Llama stack with
        its projections fused."""
        if type(base).__name__ != _CLASSES["model"]:
            return None
        config = base.config
        if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "mlp_bias", False):
            return None
        for layer in base.layers:
            parts = {
                "layer": layer,
                "attention": getattr(layer, "self_attn", None),
                "mlp": getattr(layer, "mlp", None),
            }
            if any(type(m).__name__ != _CLASSES[k] for k, m in parts.items()):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(n).__name__ != _CLASSES["norm"] for n in norms):
                return None
            if not isinstance(getattr(layer.self_attn, "fused_q_k_v", None), FusedLinear):
                return None
            if not isinstance(getattr(layer.mlp, "fused_gate_up", None), FusedLinear):
                return None
        if type(base.norm).__name__ != _CLASSES["norm"]:
            return None
        return cls(base)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` after the final norm."""
        base = self.base
        hidden = base.embed_tokens(input_ids.unsqueeze(0))
        cos, sin = base.rotary_emb(hidden, position_ids=positions.unsqueeze(0))
        # transformers rotates [1, heads, T, D] with cos [1, 1, T, D]; here [T, heads, D].
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        if self.ops is not None:
            return self._fused(hidden[0], cos, sin, ctx)
        tokens, d = input_ids.shape[0], self.head_dim
        for layer in self.layers:
            x = layer.norm_in(hidden)
            qkv = layer.qkv(x)[0]
            q = _rotate(qkv[:, : self.q_end].view(tokens, -1, d), cos, sin)
            k = _rotate(qkv[:, self.q_end : self.k_end].view(tokens, -1, d), cos, sin)
            v = qkv[:, self.k_end :].view(tokens, -1, d)
            out, _ = paged_attention(
                layer.attention,
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                None,
                scaling=layer.scaling,
                batchd_ctx=ctx,
            )
            hidden = hidden + layer.o_proj(out.reshape(1, tokens, -1).contiguous())
            x = layer.gate_up(layer.norm_post(hidden))
            hidden = hidden + layer.down(layer.act(x[..., : self.inner]) * x[..., self.inner :])
        return base.norm(hidden)[0]

    def _fused(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The same forward with the compiled layer ops: ``hidden`` [T, hidden] (updated in
        place), ``cos``/``sin`` [T, 1, D]."""
        ops, d, backend = self.ops, self.head_dim, ctx.backend
        assert ops is not None and backend is not None
        tokens = hidden.shape[0]
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        heads, kv_heads = self.q_end // d, (self.k_end - self.q_end) // d
        norms = self.norms
        x = ops.rms_norm(hidden, None, *norms[0])
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            index = layer.index
            k_cache, v_cache = ctx.k_cache[index], ctx.v_cache[index]
            ops.rope_store(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, ctx.slot_mapping)
            q = qkv[:, : self.q_end].view(tokens, heads, d).transpose(0, 1).unsqueeze(0)
            k = qkv[:, self.q_end : self.k_end].view(tokens, kv_heads, d).transpose(0, 1)
            v = qkv[:, self.k_end :].view(tokens, kv_heads, d).transpose(0, 1)
            out = backend.attend(
                ctx, index, q, k.unsqueeze(0), v.unsqueeze(0), layer.scaling, None, None
            )
            x = ops.rms_norm(hidden, layer.o_proj(out.view(tokens, -1)), *layer.post)
            x = layer.down(ops.silu_mul(layer.gate_up(x), self.inner))
            x = ops.rms_norm(hidden, x, *norms[i + 1])
        return x


def _norm(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """An RMS norm's weight and epsilon, as the compiled norm takes them."""
    return norm.weight, float(norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
