"""The compiled decode-attention kernel against the torch path it replaces: the same rows (to
float32 rounding; to bf16's in bf16) for sequences of mixed lengths, GQA, a sliding window,
one and two threads, the head sizes with their own builds (64, 128) and any other, and a query
with the model's strides; no compiler means the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.paged import DecodeGroup
from engine.attention.sdpa import _attend_decodes
from engine.cpu import kernels

KV, HEADS, DIM, BS = 3, 9, 64, 16


def _case(
    lens: list[int], seed: int = 0, dim: int = DIM
) -> tuple[DecodeGroup, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tables, free = [], torch.randperm(sum((n - 1) // BS + 1 for n in lens) + 4, generator=gen)
    pos = 0
    for n in lens:
        need = (n - 1) // BS + 1
        tables.append(free[pos : pos + need].tolist())
        pos += need
    num_blocks = len(free)
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables])
    k = torch.randn(KV, num_blocks + 1, BS, dim, generator=gen)
    v = torch.randn(KV, num_blocks + 1, BS, dim, generator=gen)
    # The model's layout: [1, H, T, D] as a transposed view of [T, H, D].
    query = torch.randn(len(lens), HEADS, dim, generator=gen).transpose(0, 1).unsqueeze(0)
    return DecodeGroup(0, len(lens), blocks, torch.tensor(lens), BS, list(lens)), query, k, v


def _torch_path(
    g: DecodeGroup, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    n, dim = g.end - g.start, query.shape[-1]
    qd = query[0].reshape(KV, HEADS // KV, n, dim)
    out = _attend_decodes(g, qd, k, v, dim**-0.5, window, None)  # [KV, n, group, D]
    return out.transpose(0, 1).reshape(n, HEADS, dim)


@pytest.fixture(scope="module")
def kernel() -> kernels.DecodeAttention:
    fn = kernels.decode_attention()
    if fn is None:
        pytest.fail("the decode kernel did not build: a C compiler is part of the test machine")
    return fn


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dim", [DIM, 128, 40])
def test_kernel_rows_equal_the_torch_path(
    kernel: kernels.DecodeAttention, threads: int, window: int | None, dim: int
) -> None:
    lens = [1, 2, 15, 16, 17, 33, 100, 257, 700]
    g, query, k, v = _case(lens, seed=threads, dim=dim)
    want = _torch_path(g, query, k, v, window)
    got = torch.empty(len(lens), HEADS, dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, window or 0, dim**-0.5, got)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [DIM, 40])
def test_bfloat16_rows_equal_the_torch_path(kernel: kernels.DecodeAttention, dim: int) -> None:
    lens = [3, 31, 64, 300]
    g, query, k, v = _case(lens, seed=7, dim=dim)
    query, k, v = query.bfloat16(), k.bfloat16(), v.bfloat16()
    want = _torch_path(g, query, k, v, None)
    got = torch.empty(len(lens), HEADS, dim, dtype=torch.bfloat16)
    kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, 0, dim**-0.5, got)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_bfloat16_rows_round_as_generate_does(kernel: kernels.DecodeAttention) -> None:
    """In bf16 the kernel rounds where torch's fused SDPA, ``generate()``'s decode attention over
    one sequence, rounds (the softmax numerators to bf16 before they weight the values): nearly
    every element is the same bf16 number (about 0.92 here; 0.64 with float32 weights), so
    greedy bf16 output follows ``generate()`` except at near-ties."""
    dim = DIM
    lens = [3, 31, 64, 300, 511]
    g, query, k, v = _case(lens, seed=7, dim=dim)
    query, k, v = query.bfloat16(), k.bfloat16(), v.bfloat16()
    got = torch.empty(len(lens), HEADS, dim, dtype=torch.bfloat16)
    kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, 0, dim**-0.5, got)
    same = 0
    for i, n in enumerate(lens):
        slots = torch.tensor([int(g.blocks[i, p // BS]) * BS + p % BS for p in range(n)])
        keys = k.reshape(KV, -1, dim)[:, slots].unsqueeze(0)
        values = v.reshape(KV, -1, dim)[:, slots].unsqueeze(0)
        q = query[0][:, i : i + 1].unsqueeze(0)
        want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        same += int((want[0, :, 0] == got[i]).sum())
    assert same / got.numel() >= 0.85, f"{same} of {got.numel()} elements equal"


def test_the_backend_sends_what_the_kernel_reads() -> None:
    from engine.attention.sdpa import _kernel_fits

    _, query, k, _ = _case([5, 9])
    assert _kernel_fits(query, k, None)
    assert _kernel_fits(query.bfloat16(), k.bfloat16(), None)
    assert not _kernel_fits(query, k, 30.0)  # soft-capping stays on the torch path
    assert not _kernel_fits(query.half(), k.half(), None)
    assert not _kernel_fits(query, k.bfloat16(), None)


def test_no_compiler_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.build("decode_attention") is None
    assert not (tmp_path / "batchd").exists()


def test_a_build_is_cached_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = kernels.build("decode_attention")
    assert first is not None and first.parent == tmp_path / "batchd" / "kernels"
    stamp = first.stat().st_mtime_ns
    assert kernels.build("decode_attention") == first
    assert first.stat().st_mtime_ns == stamp  # taken from the cache, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left


def test_packing_is_timed_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether packing pays depends on the CPU and the layer's shape, not its weights: a second
    engine load in the process reuses the verdict instead of timing again."""
    from engine.cpu import linear

    timed: list[tuple[int, int]] = []

    def fake(layer: torch.nn.Linear, rows: int, repeats: int) -> str:
        timed.append((layer.out_features, rows))
        return "mkl"

    monkeypatch.setattr(linear, "_VERDICTS", {})
    monkeypatch.setattr(linear, "_time_packing", fake)
    a, b, c = torch.nn.Linear(8, 24), torch.nn.Linear(8, 24), torch.nn.Linear(8, 40)
    assert linear.packing_for(a, 32) == linear.packing_for(b, 32) == "mkl"
    assert linear.packing_for(c, 32) == linear.packing_for(a, 64) == "mkl"
    assert timed == [(24, 32), (40, 32), (24, 64)]


def test_the_limit_is_the_kernels(kernel: kernels.DecodeAttention) -> None:
    """MAX_HEAD_DIM is where the C kernel stops; the backend's choice reads it from there."""
    lens = [3, 20]
    g, query, k, v = _case(lens, dim=kernels.MAX_HEAD_DIM)
    got = torch.empty(len(lens), HEADS, kernels.MAX_HEAD_DIM)
    kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, 0, 0.03, got)
    g, query, k, v = _case(lens, dim=kernels.MAX_HEAD_DIM + 16)
    got = torch.empty(len(lens), HEADS, kernels.MAX_HEAD_DIM + 16)
    with pytest.raises(ValueError, match="over its 1024"):
        kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, 0, 0.03, got)
    with pytest.raises(ValueError, match="out like q"):  # the binding checks shapes first
        kernel(query[0].transpose(0, 1), k, v, g.blocks, g.lens, 0, 0.03, got[:, :, :1024])


def test_heads_over_the_kernels_limit_keep_torchs_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose heads are larger than the compiled kernels take runs on torch's path,
    chosen once (logged once), and gives generate()'s text; no kernel is called."""
    import logging
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from core.llms.demo import build
    from engine import Engine, SamplingParams
    from engine.attention import sdpa

    tiny = build("llama-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, tmp_path / name)
    config = AutoConfig.from_pretrained(tiny)
    config.num_hidden_layers, config.head_dim = 1, kernels.MAX_HEAD_DIM + 16
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)

    called: list[str] = []
    real = kernels.decode_attention()
    assert real is not None

    def decode(*args):  # type: ignore[no-untyped-def]
        called.append("decode attention")
        return real(*args)

    rope = kernels.LayerOps.rope_store

    def rope_store(self, *args):  # type: ignore[no-untyped-def]
        called.append("rope")
        return rope(self, *args)

    monkeypatch.setattr(sdpa, "decode_attention", lambda: decode)
    monkeypatch.setattr(kernels.LayerOps, "rope_store", rope_store)
    prompts = [[5, 9, 100, 7], list(range(20, 60))]
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = Engine(str(tmp_path), dtype="float32")
        assert engine.runner.lean is None or engine.runner.lean.ops is None
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert called == []
    assert caplog.text.count("over the decode kernel's 1024") == 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
            )
        assert done[str(i)] == ref[0, len(prompt) :].tolist()
