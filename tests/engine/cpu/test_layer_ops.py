"""The compiled layer ops (engine/cpu/csrc/layer_ops.c) against transformers' Llama operators:
rotary embedding and the cache write exact, the RMS norm and SiLU to float32 rounding, for one
row, a decode step's rows and a prefill's; in bf16, rounded where transformers' bf16 operators
round (the rotary embedding and the residual exact, the norm and SiLU to one bf16 step)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from engine.cpu import kernels


@pytest.fixture(scope="module")
def ops() -> kernels.LayerOps:
    built = kernels.layer_ops()
    if built is None:
        # A source that does not compile must fail here, not skip every test below.
        assert shutil.which(os.environ.get("CC") or "cc") is None, "layer_ops.c did not build"
        pytest.skip("no C compiler here: the lean forward keeps torch's operators")
    return built


@pytest.mark.parametrize("rows", [1, 7, 64, 600])
def test_rms_norm_adds_the_residual_then_normalizes(
    ops: kernels.LayerOps, threads: int, rows: int
) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576)
    hidden, delta = torch.randn(rows, 576), torch.randn(rows, 1152)[:, :576]
    want_hidden = hidden + delta
    with torch.inference_mode():
        want = norm(want_hidden)
        got = ops.rms_norm(hidden, delta, norm.weight, 1e-5)
        assert torch.equal(hidden, want_hidden)  # the residual stream, updated in place
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(ops.rms_norm(hidden, None, norm.weight, 1e-5), want)


@pytest.mark.parametrize("rows", [1, 7, 64, 600])
def test_rope_rotates_in_place_and_writes_the_cache(
    ops: kernels.LayerOps, threads: int, rows: int
) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    want_v = v.clone()
    k_cache = torch.zeros(kv_heads, 50, 16, dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(50 * 16)[:rows]
    ops.rope_store(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(k_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1), want_k)
    assert torch.equal(v_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1), want_v)
    untouched = torch.ones(50 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(kv_heads, -1, dim)[:, untouched].any()


@pytest.mark.parametrize("rows", [1, 7, 64, 600])
@pytest.mark.parametrize("inner", [1536, 37])
def test_silu_mul(ops: kernels.LayerOps, threads: int, rows: int, inner: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inner + 8)[:, : 2 * inner] * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # where e^x clamps, and zero
    want = torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    torch.testing.assert_close(ops.silu_mul(gate_up, inner), want, rtol=2e-6, atol=1e-6)


# -- bf16 -------------------------------------------------------------------------------------


def _one_bf16_step(got: torch.Tensor, want: torch.Tensor, share: float) -> None:
    """``got`` is ``want`` (both bf16) in at least ``share`` of the elements, and nowhere more
    than one bf16 step of ``want``'s magnitude away."""
    assert (got == want).float().mean() >= share
    step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(2**-30))) - 7)
    assert ((got.float() - want.float()).abs() <= step).all()


@pytest.mark.parametrize("rows", [1, 64, 600])
def test_bf16_rms_norm(ops: kernels.LayerOps, threads: int, rows: int) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5).bfloat16()
    norm.weight.data = torch.randn(576).bfloat16()
    hidden = torch.randn(rows, 576).bfloat16()
    delta = torch.randn(rows, 1152).bfloat16()[:, :576]
    want_hidden = hidden + delta
    with torch.inference_mode():
        want = norm(want_hidden)
        got = ops.rms_norm(hidden, delta, norm.weight, 1e-5)
        assert torch.equal(hidden, want_hidden)  # the residual added and rounded as torch does
        _one_bf16_step(got, want, 0.99)


@pytest.mark.parametrize("rows", [1, 64])
def test_bf16_rope_is_transformers(ops: kernels.LayerOps, threads: int, rows: int) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).bfloat16()
    cos, sin = torch.randn(rows, dim).bfloat16(), torch.randn(rows, dim).bfloat16()
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    k_cache = torch.zeros(kv_heads, 10, 16, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(10 * 16)[:rows]
    ops.rope_store(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache.view(kv_heads, -1, dim)[:, slots].transpose(0, 1), want_k)


@pytest.mark.parametrize("inner", [1536, 37])
def test_bf16_silu_mul(ops: kernels.LayerOps, threads: int, inner: int) -> None:
    torch.manual_seed(inner)
    gate_up = (torch.randn(64, 2 * inner + 8)[:, : 2 * inner] * 6).bfloat16()
    want = torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    _one_bf16_step(ops.silu_mul(gate_up, inner), want, 0.99)


def test_mixed_types_are_refused(ops: kernels.LayerOps) -> None:
    hidden = torch.randn(2, 16)
    with pytest.raises(TypeError, match="rms_norm: all float32 or all bfloat16"):
        ops.rms_norm(hidden, None, torch.ones(16, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(TypeError, match="silu_mul"):
        ops.silu_mul(torch.randn(2, 8).half(), 4)


def test_odd_or_wide_heads_are_refused(ops: kernels.LayerOps) -> None:
    qkv = torch.randn(2, 5 * 3)
    cache = torch.zeros(1, 4, 16, 3)
    with pytest.raises(ValueError, match="head_dim 3"):
        ops.rope_store(
            qkv,
            3,
            1,
            torch.ones(2, 3),
            torch.ones(2, 3),
            cache,
            cache.clone(),
            torch.tensor([0, 1]),
        )


@pytest.mark.parametrize("shape", [(1, 49152), (64, 49152), (3, 17), (300, 1000)])
def test_argmax_is_torchs(ops: kernels.LayerOps, threads: int, shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[0])
    logits = torch.randn(shape[0], shape[1] + 5)[:, : shape[1]]  # a row stride past its end
    logits[0, shape[1] // 2] = logits[0, -1] = 1e9  # ties: the first wins
    if shape[0] > 2:
        logits[1, :] = -torch.inf
        logits[2, 3 % shape[1]] = torch.nan  # a NaN counts as largest, as torch counts it
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


def test_the_engine_samples_greedy_steps_with_it() -> None:
    from core.llms.demo import build
    from engine import Engine

    engine = Engine(str(build("llama-tiny")), dtype="float32")
    assert engine.sampler.argmax is not None
    assert Engine(str(build("llama-tiny")), cpu_kernels=False).sampler.argmax is None
