"""Fused projections (engine/forward/fusion.py): each layer's part of the one matmul equals what the
layer computed alone, in any order of asking, with or without bias, packed or not; what cannot
be fused is left as it was; nothing of a step is held once every part has been handed out."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from engine.cpu import kernels, linear
from engine.forward import fusion as layers


class _Attention(torch.nn.Module):
    def __init__(self, hidden: int, q: int, kv: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, q, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=bias)
        self.o_proj = torch.nn.Linear(q, hidden, bias=False)


class _Mlp(torch.nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.self_attn = _Attention(48, 48, 16, bias)
        self.mlp = _Mlp(48, 96)


def _outputs(layer: _Layer, x: torch.Tensor, order: list[str]) -> dict[str, torch.Tensor]:
    owners = {"q_proj": layer.self_attn, "k_proj": layer.self_attn, "v_proj": layer.self_attn}
    owners |= {"gate_proj": layer.mlp, "up_proj": layer.mlp}
    return {name: getattr(owners[name], name)(x).clone() for name in order}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "order",
    [
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
        ["v_proj", "q_proj", "k_proj", "up_proj", "gate_proj"],
    ],
)
def test_each_part_equals_its_layer(bias: bool, order: list[str]) -> None:
    torch.manual_seed(0)
    plain = _Layer(bias)
    fused = copy.deepcopy(plain)
    assert layers.fuse_projections(fused) == 2
    x = torch.randn(1, 5, 48)
    with torch.inference_mode():
        want, got = _outputs(plain, x, order), _outputs(fused, x, order)
    for name in order:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    assert isinstance(fused.self_attn.q_proj, layers.Slice)
    assert fused.self_attn.fused_q_k_v._output is None  # released once all parts were served
    assert fused.mlp.fused_gate_up._output is None
    # The slices own no weights: the model is not bigger than before.
    count = sum(p.numel() for p in fused.parameters())
    assert count == sum(p.numel() for p in plain.parameters())


def test_a_new_input_recomputes() -> None:
    torch.manual_seed(1)
    plain = _Layer()
    fused = copy.deepcopy(plain)
    layers.fuse_projections(fused)
    with torch.inference_mode():
        a, b = torch.randn(3, 48), torch.randn(3, 48)
        fused.self_attn.q_proj(a)  # a step that asks only for part of its input's projections
        got = fused.self_attn.q_proj(b)
        torch.testing.assert_close(got, plain.self_attn.q_proj(b))


def test_packing_swaps_the_fused_matmul() -> None:
    if not linear.packable(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed linear")
    torch.manual_seed(2)
    plain = _Layer()
    fused = copy.deepcopy(plain)
    layers.fuse_projections(fused)
    assert linear.pack_linears(fused, 8) == 4  # two fused, o_proj, down_proj
    assert isinstance(fused.self_attn.fused_q_k_v.linear, linear.PackedLinear)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        torch.testing.assert_close(fused.mlp.up_proj(x), plain.mlp.up_proj(x), rtol=1e-4, atol=1e-4)


def test_what_differs_is_left_alone() -> None:
    layer = _Layer()
    layer.self_attn.v_proj = torch.nn.Linear(32, 16)  # another input size
    layer.mlp.up_proj = torch.nn.Linear(48, 96, bias=True)  # bias where gate has none
    assert layers.fuse_projections(layer) == 0
    assert type(layer.self_attn.q_proj) is torch.nn.Linear
    assert type(layer.mlp.gate_proj) is torch.nn.Linear


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
def test_mkl_packing_serves_any_number_of_rows(rows: int) -> None:
    """MKL's packed weight is packed once (for 64 rows here) and multiplies any row count, with
    a bias, from a strided input, to float32 rounding of the plain layer."""
    if "mkl" not in linear.kinds_for(torch.float32):
        pytest.skip("this torch has no MKL packed linear")
    torch.manual_seed(3)
    plain = torch.nn.Linear(96, 160)
    packed = linear.PackedLinear.of(plain, 64, "mkl")
    x = torch.randn(rows, 192)[:, ::2]
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
        assert packed(x.reshape(1, rows, 96)).shape == (1, rows, 160)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 8, 11, 12, 13, 64, 300])
def test_the_compiled_gemm_serves_any_rows_and_columns(rows: int, bias: bool) -> None:
    """engine/cpu/csrc/sgemm.c: 12-row tiles and a last tile of the rows left, 32-column panels with
    a partial last one (50 outputs), a strided input, a bias: float32 rounding of the plain
    layer."""
    if "batchd" not in linear.kinds_for(torch.float32):
        if shutil.which(os.environ.get("CC") or "cc") is not None:
            assert kernels.build("sgemm") is not None, "sgemm.c did not build"
        pytest.skip("no compiler or no AVX-512 here: float32 linears keep oneDNN or MKL")
    torch.manual_seed(rows)
    for outputs in (50, 96):
        plain = torch.nn.Linear(96, outputs, bias=bias)
        packed = linear.PackedLinear.of(plain, 64, "batchd")
        x = torch.randn(rows, 192)[:, ::2]
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
            assert packed(x.reshape(1, rows, 96)).shape == (1, rows, outputs)


def test_a_row_of_the_compiled_gemm_is_the_same_in_any_step() -> None:
    """A row's output does not depend on how many rows share the call (so on the tile it lands
    in): a sequence's logits are the same whatever else the step holds, as greedy equality
    with generate() one request at a time needs. Bit for bit, every row count 1-40."""
    if "batchd" not in linear.kinds_for(torch.float32):
        pytest.skip("no compiler or no AVX-512 here: float32 linears keep oneDNN or MKL")
    torch.manual_seed(7)
    packed = linear.PackedLinear.of(torch.nn.Linear(96, 80), 64, "batchd")
    x = torch.randn(40, 96)
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(40)])
        for rows in range(1, 41):
            assert torch.equal(packed(x[:rows]), alone[:rows]), rows


def _bgemm_here() -> None:
    if "batchd" not in linear.kinds_for(torch.bfloat16):
        if shutil.which(os.environ.get("CC") or "cc") is not None:
            assert kernels.build("bgemm") is not None, "bgemm.c did not build"
        pytest.skip("no compiler or no AVX-512 BF16 here: bf16 linears keep oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 11, 12, 13, 64, 300])
def test_the_compiled_bf16_gemm_serves_any_rows_and_columns(rows: int, bias: bool) -> None:
    """engine/cpu/csrc/bgemm.c: the tiles of the float32 GEMM over pairs of k (an odd k's last
    element alone), a partial last panel, a strided input, a bias: the float64 product of the
    same bf16 numbers, rounded once to bf16 (a float32 sum can round the other way at a
    tie: at most one bf16 step apart), and oneDNN's bf16 linear to the bit nearly always."""
    _bgemm_here()
    torch.manual_seed(rows)
    for inputs, outputs in ((96, 50), (97, 96), (576, 40)):
        plain = torch.nn.Linear(inputs, outputs, bias=bias).bfloat16()
        packed = linear.PackedLinear.of(plain, 64, "batchd")
        onednn = linear.PackedLinear.of(plain, 64, "onednn")
        x = torch.randn(rows, 2 * inputs).bfloat16()[:, ::2]
        with torch.inference_mode():
            got = packed(x)
            exact = x.double() @ plain.weight.double().T
            if bias:
                exact += plain.bias.double()
            step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2**-30))) - 7)
            assert ((got.double() - exact).abs() <= step).all()
            assert (got == onednn(x)).float().mean() > 0.99
            assert packed(x.reshape(1, rows, inputs)).shape == (1, rows, outputs)


def test_a_row_of_the_compiled_bf16_gemm_is_the_same_in_any_step() -> None:
    """As in float32: bit for bit whatever the rows beside it (oneDNN's bf16 GEMM is not: it
    sums a 1,536-wide row in another order from about 30 rows)."""
    _bgemm_here()
    torch.manual_seed(7)
    packed = linear.PackedLinear.of(torch.nn.Linear(1536, 80).bfloat16(), 64, "batchd")
    x = torch.randn(70, 1536).bfloat16()
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(70)])
        for rows in range(1, 71):
            assert torch.equal(packed(x[:rows]), alone[:rows]), rows


def test_the_gemm_refuses_what_it_was_not_packed_for() -> None:
    _bgemm_here()
    packed = linear.PackedLinear.of(torch.nn.Linear(64, 32).bfloat16(), 64, "batchd")
    with pytest.raises(TypeError, match="torch.bfloat16 rows"):
        packed(torch.randn(3, 64))
    with pytest.raises(ValueError, match="packed for 32 x 64"):
        packed.gemm.linear(torch.randn(3, 64).bfloat16(), packed.packed[:-2], 32, None)


def test_the_bf16_gemm_is_not_offered_without_avx512_bf16(avx2_build) -> None:  # type: ignore[no-untyped-def]
    """Built without the bf16 dot-product instruction the library has nothing to run."""
    assert avx2_build("bgemm") is not None
    assert kernels.bgemm() is None
    assert linear.kinds_for(torch.bfloat16) == ("onednn",)


def test_the_compiled_gemm_is_not_offered_without_avx512(avx2_build) -> None:  # type: ignore[no-untyped-def]
    """Built for AVX2 its 24 accumulators spill: the packing is not offered there."""
    assert avx2_build("sgemm") is not None
    assert kernels.sgemm() is None
    assert "batchd" not in linear.kinds_for(torch.float32)


def test_the_fastest_packing_wins_if_it_pays() -> None:
    """The verdict is the fastest packing, and only where it beats the plain weight by 10%."""
    assert linear.fastest({"plain": 1.0, "onednn": 0.8, "mkl": 0.7}) == "mkl"
    assert linear.fastest({"plain": 1.0, "onednn": 0.8, "mkl": 0.85}) == "onednn"
    assert linear.fastest({"plain": 1.0, "onednn": 0.95, "mkl": 0.91}) is None
    assert linear.fastest({"plain": 1.0}) is None


def test_timing_packing_measures_every_kind_here() -> None:
    if not linear.packable(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed linear")
    verdict = linear._time_packing(torch.nn.Linear(64, 96), 32, 2)
    assert verdict is None or verdict in linear.kinds_for(torch.float32)
