"""The compiled prefill attention (engine/cpu/csrc/prefill_attention.c) against causal attention
computed in float64: chunks that start their sequence (keys from the step's own strided K/V)
and chunks that continue it (keys read through a scattered block table), head sizes 16 to 128,
grouped and plain heads, one and two threads, float32 and bfloat16, and the backend's choice."""

from __future__ import annotations

import ctypes
import os
import shutil
import time

import pytest
import torch

from engine.attention.paged import AttentionContext, PrefillChunk
from engine.attention.sdpa import SdpaBackend
from engine.cpu import kernels

BLOCK = 16


@pytest.fixture(scope="module")
def kernel() -> kernels.PrefillAttention:
    built = kernels.prefill_attention()
    if built is None:
        # A source that does not compile must fail here, not skip every test below.
        if shutil.which(os.environ.get("CC") or "cc") is None:
            pytest.skip("no C compiler here: prefill chunks keep torch's flash operator")
        assert kernels.build("prefill_attention") is not None, "prefill_attention.c did not build"
        pytest.skip("no AVX-512 here: prefill chunks keep torch's flash operator")
    return built


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float):
    """Causal attention in float64: ``q`` [n, H, D] at positions first_pos.., ``k``/``v``
    [KV, keys, D]; returns [n, H, D] float32."""
    n, heads, _ = q.shape
    group = heads // k.shape[0]
    k, v = k.repeat_interleave(group, 0).double(), v.repeat_interleave(group, 0).double()
    scores = torch.einsum("nhd,hkd->hnk", q.double(), k) * scale
    pos = torch.arange(n)[:, None] + first_pos
    scores = scores.masked_fill(torch.arange(k.shape[1])[None] > pos, float("-inf"))
    return torch.einsum("hnk,hkd->nhd", torch.softmax(scores, -1), v).float()


def _step(n: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """A fused q/k/v output of ``n`` rows, as the lean forward has it, and its q/k/v views."""
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim).transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim).transpose(0, 1)
    return q, k, v


def _paged(keys: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A layer's cache with ``keys`` keys scattered over its blocks, the sequence's block
    table, and the same keys and values in order ([KV, keys, D])."""
    g = torch.Generator().manual_seed(seed)
    width = -(-keys // BLOCK)
    total = width + 7
    k_cache = torch.randn(kv_heads, total, BLOCK, dim, generator=g)
    v_cache = torch.randn(kv_heads, total, BLOCK, dim, generator=g)
    blocks = torch.randperm(total, generator=g)[:width].long()
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:keys]
    k = k_cache.view(kv_heads, -1, dim)[:, slots]
    v = v_cache.view(kv_heads, -1, dim)[:, slots]
    return k_cache, v_cache, blocks, k, v


@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("n", [1, 16, 17, 130, 700])
def test_a_chunk_that_starts_its_sequence(
    kernel: kernels.PrefillAttention, threads: int, dim: int, heads: int, kv_heads: int, n: int
) -> None:
    torch.manual_seed(n + dim + heads)
    q, k, v = _step(n, heads, kv_heads, dim)
    out = torch.full((n, heads, dim), float("nan"))
    assert kernel(q, k, v, None, BLOCK, 0, 0.125, out)
    torch.testing.assert_close(out, _reference(q, k, v, 0, 0.125), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (3, 1)])
@pytest.mark.parametrize("first_pos,n", [(5, 1), (37, 16), (100, 64), (513, 200), (1000, 3)])
def test_a_chunk_that_continues_its_sequence(
    kernel: kernels.PrefillAttention,
    threads: int,
    dim: int,
    heads: int,
    kv_heads: int,
    first_pos: int,
    n: int,
) -> None:
    """Every key, the chunk's own included, read from the cache through a shuffled block
    table: the queries see all the cached keys and their own causally."""
    k_cache, v_cache, blocks, k, v = _paged(first_pos + n, kv_heads, dim, seed=first_pos + n)
    q = torch.randn(n, 2 * heads, dim)[:, ::2]  # a head stride other than dim
    out = torch.full((n, heads, dim), float("nan"))
    assert kernel(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, out)
    torch.testing.assert_close(out, _reference(q, k, v, first_pos, 0.1), rtol=1e-5, atol=2e-5)


# -- bfloat16 ------------------------------------------------------------------------------------
# bf16 is widened on load and summed in float32; the softmax numerators are rounded to bf16
# before they weight the values and the output at the end, as torch's CPU flash attention does.
# Against float64 attention of the same bf16 inputs the error is that of those two roundings.
BF16_TOL = {"rtol": 2**-7, "atol": 2**-7}


def _bf16(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.bfloat16() for t in tensors]


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("n", [16, 130, 700])
def test_a_bf16_chunk_that_starts_its_sequence(
    kernel: kernels.PrefillAttention, threads: int, dim: int, heads: int, kv_heads: int, n: int
) -> None:
    torch.manual_seed(n + dim + heads)
    q, k, v = _bf16(*_step(n, heads, kv_heads, dim))
    out = torch.full((n, heads, dim), float("nan"), dtype=torch.bfloat16)
    assert kernel(q, k, v, None, BLOCK, 0, 0.125, out)
    torch.testing.assert_close(out.float(), _reference(q, k, v, 0, 0.125), **BF16_TOL)


@pytest.mark.parametrize("first_pos,n", [(37, 16), (513, 200), (2100, 40)])
def test_a_bf16_chunk_that_continues_its_sequence(
    kernel: kernels.PrefillAttention, threads: int, first_pos: int, n: int
) -> None:
    """Through a shuffled block table, and past one tile of keys (2,048): the value sums carry
    across tiles in float32, not in the bf16 output."""
    k_cache, v_cache, blocks, k, v = _paged(first_pos + n, 3, 64, seed=first_pos + n)
    k_cache, v_cache, k, v = _bf16(k_cache, v_cache, k, v)
    q = torch.randn(n, 18, 64).bfloat16()[:, ::2]
    out = torch.full((n, 9, 64), float("nan"), dtype=torch.bfloat16)
    assert kernel(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, out)
    torch.testing.assert_close(out.float(), _reference(q, k, v, first_pos, 0.1), **BF16_TOL)


def test_bf16_rounds_where_torchs_flash_operator_rounds(kernel: kernels.PrefillAttention) -> None:
    """Beside torch's own bf16 flash attention (what ``generate()`` runs): most elements are
    the same bf16 number, and the kernel is as close to float64 attention as torch is."""
    torch.manual_seed(3)
    n, heads, kv_heads, dim = 600, 9, 3, 64
    q, k, v = _bf16(*_step(n, heads, kv_heads, dim))
    out = torch.empty(n, heads, dim, dtype=torch.bfloat16)
    assert kernel(q, k, v, None, BLOCK, 0, dim**-0.5, out)
    group = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.repeat_interleave(group, 0).unsqueeze(0),
        v.repeat_interleave(group, 0).unsqueeze(0),
        is_causal=True,
    )[0].transpose(0, 1)
    assert (out == want).float().mean() > 0.6  # 0.72 here
    exact = _reference(q.double(), k.double(), v.double(), 0, dim**-0.5)
    assert (out.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max()


def test_mixed_element_types_are_refused(kernel: kernels.PrefillAttention) -> None:
    q, k, v = _step(32, 4, 2, 64)
    out = torch.zeros(32, 4, 64)
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        kernel(q.bfloat16(), k, v, None, BLOCK, 0, 0.1, out)
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        kernel(q.half(), k.half(), v.half(), None, BLOCK, 0, 0.1, out.half())
    assert not out.any()


def test_large_scores_stay_finite(kernel: kernels.PrefillAttention) -> None:
    """Scores in the hundreds: the running maximum keeps every exponential in range, and a
    row whose first block it leaves early is not rescaled into NaN."""
    torch.manual_seed(0)
    q, k, v = _step(300, 9, 3, 64)
    q.mul_(30.0)
    out = torch.empty(300, 9, 64)
    assert kernel(q, k, v, None, BLOCK, 0, 0.125, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, k, v, 0, 0.125), rtol=1e-4, atol=1e-4)


def test_other_head_sizes_are_declined(kernel: kernels.PrefillAttention) -> None:
    q, k, v = _step(32, 4, 2, 96)
    out = torch.zeros(32, 4, 96)
    assert not kernel(q, k, v, None, BLOCK, 0, 0.1, out)
    assert not out.any()  # nothing written


def _backend_case(first_pos: int, n: int) -> tuple:
    heads, kv_heads, dim = 9, 3, 64
    k_cache, v_cache, blocks, k, v = _paged(first_pos + n, kv_heads, dim, seed=n)
    q = torch.randn(1, heads, n, dim)
    chunk = PrefillChunk(0, n, first_pos + n if first_pos else 0, first_pos=first_pos)
    if first_pos:
        chunk.blocks = blocks
    ctx = AttentionContext([k_cache], [v_cache], torch.zeros(n, dtype=torch.long))
    ctx.prefills.append(chunk)
    own_k, own_v = k[:, first_pos:].unsqueeze(0), v[:, first_pos:].unsqueeze(0)
    return ctx, q, own_k, own_v, k, v


@pytest.mark.parametrize("first_pos", [0, 40])
def test_the_backend_sends_float32_chunks_to_the_kernel(
    kernel: kernels.PrefillAttention, monkeypatch: pytest.MonkeyPatch, first_pos: int
) -> None:
    """Every chunk goes to the kernel, one query or many (its keys in place: the step's own for
    a first chunk, the cache's for a later one), and its output is causal attention's."""
    backend = SdpaBackend()
    assert backend.prefill is not None
    calls: list[int] = []

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(backend, "prefill", counted)
    for n in (1, 15, 16, 90):
        ctx, q, own_k, own_v, k, v = _backend_case(first_pos, n)
        out = backend.attend(ctx, 0, q, own_k, own_v, 0.125, None, None)
        want = _reference(q[0].transpose(0, 1), k, v, first_pos, 0.125)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-5)
    assert calls == [1, 15, 16, 90]


def test_a_window_or_softcap_keeps_torchs_path(
    kernel: kernels.PrefillAttention, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SdpaBackend()
    monkeypatch.setattr(backend, "prefill", lambda *a: pytest.fail("the kernel was called"))
    ctx, q, own_k, own_v, _, _ = _backend_case(0, 64)
    backend.attend(ctx, 0, q, own_k, own_v, 0.125, 32, None)
    ctx, q, own_k, own_v, _, _ = _backend_case(0, 64)
    backend.attend(ctx, 0, q, own_k, own_v, 0.125, None, 30.0)


def test_a_chunk_off_the_cpu_never_reaches_the_kernel() -> None:
    """The kernel reads host memory: a float32 chunk on another device (``attention_backend
    "sdpa"`` on a GPU) keeps torch's operator. Meta tensors stand in for the device here."""
    n, heads, kv_heads, dim = 64, 9, 3, 64
    q = torch.empty(heads, n, dim, device="meta")
    key = value = torch.empty(1, kv_heads, n, dim, device="meta")
    cache = torch.empty(kv_heads, 8, BLOCK, dim, device="meta")
    chunk = PrefillChunk(0, n, 2 * n, first_pos=n)
    chunk.blocks = torch.arange(8, device="meta")
    out = torch.empty(n, heads, dim, device="meta")

    def kernel(*args):  # type: ignore[no-untyped-def]
        pytest.fail("the kernel was called")

    assert not SdpaBackend._compiled(kernel, chunk, q, key, value, cache, cache, 0.125, out)


def test_a_build_without_avx512_is_not_used(avx2_build) -> None:  # type: ignore[no-untyped-def]
    """Built for AVX2 the kernel compiles and computes right but runs at a tenth of torch's
    operator (its sixteen-float row blocks spill): the engine does not take it there."""
    assert avx2_build("prefill_attention") is not None
    assert kernels.prefill_attention() is None


# -- the scratch it keeps -----------------------------------------------------------------------
# Built for AVX2 the kernel is slow (the engine does not take it there) but computes the same: it
# checks the tiles and the scratch on any x86-64 machine, AVX-512 or not.

TILE_KEYS = 2048  # prefill_attention.c's default


@pytest.fixture
def avx2_kernel(avx2_build) -> kernels.PrefillKernel:  # type: ignore[no-untyped-def]
    path = avx2_build("prefill_attention")
    assert path is not None, "prefill_attention.c did not build"
    kernel = kernels.PrefillKernel(ctypes.CDLL(str(path)))
    kernel.release()
    return kernel


def _continued(kernel: kernels.PrefillKernel, keys: int, n: int, kv_heads: int, dim: int) -> None:
    """A chunk of ``n`` queries ending at ``keys`` keys through a scattered block table,
    against the float64 reference."""
    heads = kv_heads * 2
    k_cache, v_cache, blocks, k, v = _paged(keys, kv_heads, dim, seed=keys)
    q = torch.randn(n, heads, dim)
    out = torch.empty(n, heads, dim)
    assert kernel(q, k_cache, v_cache, blocks, BLOCK, keys - n, 0.1, out)
    torch.testing.assert_close(out, _reference(q, k, v, keys - n, 0.1), rtol=1e-4, atol=1e-4)


def test_the_scratch_grows_to_one_tile_and_no_further(
    avx2_kernel: kernels.PrefillKernel, threads: int
) -> None:
    """Prompts of growing length: what a calling thread keeps is the bound at most (one tile of
    transposed keys), whatever the length, and the output stays right past a tile."""
    kv_heads, dim = 2, 64
    bound = avx2_kernel.scratch_bound(kv_heads, dim)
    assert bound == 4 * kv_heads * dim * TILE_KEYS + 8 * TILE_KEYS
    assert avx2_kernel.scratch_bytes() == 0
    held = []
    for keys in (40, 700, TILE_KEYS - 1, TILE_KEYS + 1, 3 * TILE_KEYS + 77, 9000):
        _continued(avx2_kernel, keys, 24, kv_heads, dim)
        held.append(avx2_kernel.scratch_bytes())
    assert 0 < held[0] < held[1] < bound
    assert held[2:] == [bound] * 4
    avx2_kernel.release()
    assert avx2_kernel.scratch_bytes() == 0


def test_a_threads_scratch_goes_with_it(avx2_kernel: kernels.PrefillKernel) -> None:
    import threading

    worker = threading.Thread(target=_continued, args=(avx2_kernel, 300, 16, 2, 16))
    worker.start()
    worker.join()
    # join() returns when Python is done with the thread, a moment before the thread exits.
    deadline = time.monotonic() + 5
    while avx2_kernel.scratch_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert avx2_kernel.scratch_bytes() == 0


def test_tiles_give_the_same_bits(
    avx2_build,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """A build whose tile is two blocks (128 keys) returns what the one-tile build returns, to
    the bit: the running softmax carries across tiles exactly, over the same blocks."""
    whole = kernels.PrefillKernel(ctypes.CDLL(str(avx2_build("prefill_attention"))))
    monkeypatch.setattr(kernels, "FLAGS", (*kernels.FLAGS, "-DTILE_KEYS=128"))
    small = kernels.PrefillKernel(ctypes.CDLL(str(kernels.build("prefill_attention"))))
    assert small.scratch_bound(3, 64) == 4 * 3 * 64 * 128 + 8 * 128
    torch.manual_seed(5)
    for dim, heads, kv_heads, n in ((64, 9, 3, 300), (16, 4, 2, 130), (128, 8, 2, 40)):
        q, k, v = _step(n, heads, kv_heads, dim)
        a, b = torch.empty(n, heads, dim), torch.empty(n, heads, dim)
        assert whole(q, k, v, None, BLOCK, 0, 0.125, a)
        assert small(q, k, v, None, BLOCK, 0, 0.125, b)
        assert torch.equal(a, b)
        torch.testing.assert_close(b, _reference(q, k, v, 0, 0.125), rtol=1e-5, atol=2e-5)
    for first_pos, n in ((500, 90), (100, 16), (1000, 200)):
        k_cache, v_cache, blocks, k, v = _paged(first_pos + n, 3, 64, seed=n)
        q = torch.randn(n, 9, 64)
        a, b = torch.empty(n, 9, 64), torch.empty(n, 9, 64)
        assert whole(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, a)
        assert small(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, b)
        assert torch.equal(a, b)
        torch.testing.assert_close(b, _reference(q, k, v, first_pos, 0.1), rtol=1e-5, atol=2e-5)
        # bf16: the sums carry across tiles in float32 beside the bf16 output.
        q, k_cache, v_cache = _bf16(q, k_cache, v_cache)
        a, b = a.bfloat16(), b.bfloat16()
        assert whole(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, a)
        assert small(q, k_cache, v_cache, blocks, BLOCK, first_pos, 0.1, b)
        assert torch.equal(a, b)
