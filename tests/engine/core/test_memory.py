"""The KV memory budget: its arithmetic, the error when one sequence cannot fit, and the
profiling forward (which must leave the model as it found it)."""

from __future__ import annotations

import pytest
import torch

from core.llms.demo import build
from engine import LLM, Engine, SamplingParams
from engine.core import memory
from engine.core.config import DEFAULT_CPU_KV_BYTES

MiB = 1 << 20


def test_bytes_are_used_as_given_everywhere() -> None:
    assert memory.kv_budget_bytes(123_456, free_bytes=None) == 123_456
    assert memory.kv_budget_bytes(123_456, free_bytes=10, activation_peak_bytes=5) == 123_456


def test_fraction_on_cpu_applies_to_the_fixed_pool() -> None:
    assert memory.kv_budget_bytes(0.5, free_bytes=None) == DEFAULT_CPU_KV_BYTES // 2


def test_fraction_on_a_device_is_of_free_memory_less_the_activation_peak() -> None:
    # 10 GiB free after the weights, a 2 GiB activation peak: 90% of the 8 GiB left.
    free, peak = 10 * 1024 * MiB, 2 * 1024 * MiB
    assert memory.kv_budget_bytes(0.9, free_bytes=free, activation_peak_bytes=peak) == int(
        0.9 * 8 * 1024 * MiB
    )
    # A peak above what is free leaves nothing (never a negative budget).
    assert memory.kv_budget_bytes(0.9, free_bytes=MiB, activation_peak_bytes=2 * MiB) == 0


def test_blocks_are_what_fits_capped_at_every_sequence_at_full_length() -> None:
    kw = {"bytes_per_block": MiB, "block_size": 16, "max_model_len": 100, "max_num_seqs": 4}
    assert memory.blocks_per_sequence(100, 16) == 7
    assert memory.num_kv_blocks(20 * MiB + 5, **kw) == 20
    assert memory.num_kv_blocks(1000 * MiB, **kw) == 4 * 7  # more would never be used
    assert memory.num_kv_blocks(7 * MiB, **kw) == 7  # exactly one full-length sequence


def test_a_budget_below_one_full_length_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as err:
        memory.num_kv_blocks(
            6 * MiB,
            bytes_per_block=MiB,
            block_size=16,
            max_model_len=100,
            max_num_seqs=4,
            describe=" (kv_cache_memory 0.5)",
        )
    text = str(err.value)
    assert "max_model_len 100 needs 7 blocks" in text and "6 blocks" in text
    assert "kv_cache_memory 0.5" in text and "raise kv_cache_memory" in text


def test_engine_refuses_a_budget_that_cannot_hold_max_model_len() -> None:
    path = build("llama-tiny")
    with pytest.raises(ValueError, match="max_model_len 512 needs 32 blocks"):
        Engine(path, kv_cache_memory=4096, max_model_len=512)
    # The explicit block count stays an override, however small (tests force preemption so).
    assert Engine(path, num_kv_blocks=4, max_model_len=512).runner.num_blocks == 4


def test_profiling_forward_runs_and_restores_the_paged_attention() -> None:
    path = build("llama-tiny")
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=96, max_model_len=64)
    runner = llm.engine.runner
    before = runner.model.config._attn_implementation
    peak = memory.profile_activation_peak(
        runner.model, num_tokens=96, max_model_len=64, num_sampled=8, device=runner.device
    )
    if runner.device.type == "cpu":
        assert peak == 0  # the CPU keeps no allocator statistics
    else:  # at least the logits of the sampled rows
        assert peak >= 8 * runner.vocab_size * 4
    assert runner.model.config._attn_implementation == before
    # The engine still runs through its paged attention (it would fail without batchd_ctx
    # handling, or differ from generate(), if the profile had left "sdpa" behind).
    from transformers import AutoModelForCausalLM

    prompt = list(range(5, 40))
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ref = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        min_new_tokens=6,
    )[0, len(prompt) :].tolist()
    assert list(out.outputs[0].token_ids) == ref


def test_the_prefill_kernels_scratch_comes_off_the_budget(
    avx2_build,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """Where the engine takes the compiled prefill kernel, the tile of keys it keeps between
    steps is memory outside the KV cache: the budget that sizes the cache subtracts it. (Built
    for AVX2 here, where the engine would not take it, to run on any x86-64 machine; it
    computes the same, so the output is the torch path's.)"""
    import ctypes

    from engine.attention import sdpa
    from engine.cpu import kernels

    kernel = kernels.PrefillKernel(ctypes.CDLL(str(avx2_build("prefill_attention"))))
    kernel.release()
    cpu = torch.device("cpu")

    class Backend:
        prefill: object = kernel

    shape = {"kv_heads": 2, "head_dim": 16}
    bound = kernel.scratch_bound(2, 16)
    assert memory.kernel_scratch_bytes(Backend(), **shape, dtype=torch.float32, device=cpu) == bound
    assert (
        memory.kernel_scratch_bytes(Backend(), **shape, dtype=torch.bfloat16, device=cpu) == bound
    )
    assert memory.kernel_scratch_bytes(Backend(), **shape, dtype=torch.float16, device=cpu) == 0
    cuda = torch.device("cuda")
    assert memory.kernel_scratch_bytes(Backend(), **shape, dtype=torch.float32, device=cuda) == 0
    Backend.prefill = None
    assert memory.kernel_scratch_bytes(Backend(), **shape, dtype=torch.float32, device=cpu) == 0

    path = build("llama-tiny")  # two KV heads of 16
    budget = 300 * 8192  # 300 blocks of 16 tokens: 2 layers x K/V x 2 heads x 16 x 4 bytes
    prompt = list(range(5, 200))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, prefill in (("kernel", kernel), ("torch", None)):
        monkeypatch.setattr(sdpa, "prefill_attention", lambda prefill=prefill: prefill)
        llm = LLM(path, kv_cache_memory=budget, dtype="float32", max_model_len=512)
        runner = llm.engine.runner
        assert runner.bytes_per_block == 8192
        assert runner.backend.prefill is prefill
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        runs[name] = (runner.num_blocks, list(out.outputs[0].token_ids))
    assert runs["torch"][0] == 300 - 1  # less the scratch block
    assert runs["kernel"][0] == (budget - 8192 - bound) // 8192
    assert runs["kernel"][1] == runs["torch"][1]
    assert 0 < kernel.scratch_bytes() <= bound  # the kernel did run
