"""Neither backend's operator calls per decode step grow with the number of running sequences
(the CPU-visible proxy for kernel launches on a GPU; the CPU backend attends all decode rows of
similar length together), and the device-independent parts of decode CUDA graphs: bucket choice
and the padding of static buffers."""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine import Engine, SamplingParams
from engine.core.cuda_graph import DecodeGraphs, bucket_for, graph_buckets


def decode_step_ops(
    path: str,
    backend: str,
    num_seqs: int,
    prompt_len: int,
    dtype: str = "float32",
    cpu_kernels: bool = True,
) -> int:
    """Operator calls (``torch.profiler`` events) of one engine step in which all ``num_seqs``
    sequences decode."""
    blocks_per_seq = -(-(prompt_len + 8) // 16)
    engine = Engine(
        path,
        attention_backend=backend,
        dtype=dtype,
        max_num_seqs=num_seqs,
        num_kv_blocks=num_seqs * blocks_per_seq,
        max_num_batched_tokens=max(2048, num_seqs * prompt_len),
        enable_prefix_caching=False,
        cpu_kernels=cpu_kernels,
        # Both engines' linears plain: a packed linear is fewer operator calls, and the verdict
        # for 16 and for 64 rows may differ, which would say nothing of the attention measured.
        cpu_gemm="plain",
    )
    rng = random.Random(num_seqs)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(
            str(i), [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)], params
        )
    engine.step()  # every prompt in one step
    engine.step()  # a first decode step, unmeasured (lazy initialisation)
    running = engine.scheduler.running
    if len(running) != num_seqs or any(s.num_computed_tokens != len(s) - 1 for s in running):
        raise RuntimeError("the measured step is not a decode step of every sequence")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return len(prof.events())


@pytest.mark.parametrize(
    "backend, dtype, cpu_kernels",
    [
        ("flex", "float32", True),
        ("sdpa", "float32", True),  # the compiled decode kernel
        ("sdpa", "bfloat16", True),
        ("sdpa", "bfloat16", False),  # torch's SDPA over padded groups
    ],
)
def test_operator_calls_per_decode_step_are_flat(
    path: str, backend: str, dtype: str, cpu_kernels: bool
) -> None:
    ops = [
        decode_step_ops(path, backend, n, prompt_len=12, dtype=dtype, cpu_kernels=cpu_kernels)
        for n in (16, 64)
    ]
    assert abs(ops[1] - ops[0]) <= 0.05 * ops[0], (
        f"{backend} in {dtype}: {ops} operator calls at 16 and 64 sequences"
    )


def test_the_counter_sees_a_call_per_sequence(path: str) -> None:
    """Without the compiled kernel, in float32 the CPU backend attends each decode row with its
    own SDPA call (the faster there): the counter tells that from flat, so the flat counts
    above mean something."""
    ops = [decode_step_ops(path, "sdpa", n, prompt_len=12, cpu_kernels=False) for n in (16, 64)]
    assert ops[1] > 1.5 * ops[0], f"sdpa in float32: {ops}"


def test_decode_groups_bound_the_padding() -> None:
    """Sorted by blocks, a group ends where a sequence needs over 1.5x and over 8 more blocks
    than the group's first: short contexts of any mix share one group."""
    from engine.core.model_runner import _decode_groups

    assert _decode_groups([]) == []
    assert _decode_groups([1, 2, 5, 9]) == [4]
    assert _decode_groups([1, 2, 10, 12, 20, 40, 41]) == [2, 4, 5, 7]
    assert _decode_groups([63, 80, 94, 95, 125]) == [3, 5]


def test_graph_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = graph_buckets(32)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 31, 32)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        32,
        32,
    ]
    assert bucket_for(33, buckets) is None


@pytest.mark.parametrize("num_seqs, bucket", [(3, 4), (5, 8), (8, 8)])
def test_padded_static_decode_matches_the_eager_step(path: str, num_seqs: int, bucket: int) -> None:
    """The graph's step function on padded static buffers (run here without a graph) gives the
    eager step's logits for the real rows, and padding writes nowhere but the scratch block."""
    engine = Engine(path, attention_backend="flex", num_kv_blocks=48, max_num_seqs=8)
    rng = random.Random(num_seqs)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 2048) for _ in range(rng.randint(5, 60))]
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
    engine.step()
    runner = engine.runner
    scheduled = engine.scheduler.schedule()
    assert len(scheduled) == num_seqs and all(n == 1 for _, n in scheduled)
    batch = runner.prepare(scheduled)
    with torch.inference_mode():
        want = runner.eager_forward(batch)
    real_k = [k[:, : runner.num_blocks].clone() for k in runner.k_cache]

    graphs = DecodeGraphs(runner, 8)
    assert bucket_for(num_seqs, graphs.buckets) == bucket
    static = graphs.buffers(bucket)
    static.block_to_logical[:] = 7  # stale contents of an earlier, larger step
    graphs.load(static, batch)
    with torch.inference_mode():
        got = graphs.step(static)
    assert got.shape[0] == bucket
    torch.testing.assert_close(got[:num_seqs], want, rtol=1e-5, atol=1e-5)
    # The real rows rewrite their own slots (the same K up to float rounding: another batch
    # shape); every other slot of a real block is untouched.
    written = batch.ctx.slot_mapping
    for before, k in zip(real_k, runner.k_cache, strict=True):
        # [KV, slots, D]: a slot of every head
        b, a = before.flatten(1, 2), k[:, : runner.num_blocks].flatten(1, 2)
        torch.testing.assert_close(a[:, written], b[:, written], rtol=1e-5, atol=1e-5)
        a[:, written] = b[:, written]
        assert torch.equal(a, b), "padding rows wrote into a real block"
    assert (static.slot_mapping[num_seqs:] == runner.scratch_block * runner.block_size).all()
