"""The correctness oracle: greedy engine output equals transformers' ``generate()`` run one
request at a time, token for token, under every scheduling regime the engine has."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
import torch

from core.llms.demo import build
from engine import Engine, SamplingParams
from engine.cpu.kernels import layer_ops

NUM_REQUESTS = 32


@dataclass
class Case:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


def _cases(seed: int, shared_prefixes: bool) -> list[Case]:
    rng = random.Random(seed)
    vocab = 2048
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 160, 250, 300, 317]
    lengths += [rng.randint(1, 320) for _ in range(NUM_REQUESTS - len(lengths))]
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (48, 130, 200)]
    cases = []
    for i, n in enumerate(lengths):
        if shared_prefixes:
            prefix = prefixes[i % len(prefixes)]
            prompt = prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
        cases.append(Case(prompt, rng.choice([1, 2, 5, 9, 16, 24]), ignore_eos=i % 3 != 0))
    return cases


def _hf_reference(path: str, cases: list[Case]) -> list[list[int]]:
    """Greedy continuation by transformers, one request at a time, never stopping at eos
    (the eos cut is applied afterwards for the requests that honour it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for case in cases:
            ids = torch.tensor([case.prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=case.max_tokens,
                do_sample=False,
                generation_config=config,
            )
            tokens = gen[0, len(case.prompt) :].tolist()
            assert len(tokens) == case.max_tokens
            out.append(tokens)
    return out


@pytest.fixture(scope="module", params=["llama-tiny", "qwen2-tiny"])
def model(request: pytest.FixtureRequest) -> dict:
    path = str(build(request.param))
    plain = _cases(1, shared_prefixes=False)
    shared = _cases(2, shared_prefixes=True)
    return {
        "path": path,
        "plain": (plain, _hf_reference(path, plain)),
        "shared": (shared, _hf_reference(path, shared)),
    }


def _expected(reference: list[int], case: Case, eos: set[int]) -> list[int]:
    if case.ignore_eos:
        return reference
    for i, t in enumerate(reference):
        if t in eos:
            return reference[: i + 1]
    return reference


def _run(engine: Engine, cases: list[Case]) -> dict[str, object]:
    for i, case in enumerate(cases):
        params = SamplingParams(
            max_tokens=case.max_tokens, temperature=0.0, ignore_eos=case.ignore_eos
        )
        engine.add_request(str(i), case.prompt, params)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        steps += 1
        assert steps < 10_000
    assert len(done) == len(cases)
    return done


def _check(engine: Engine, cases: list[Case], reference: list[list[int]]) -> dict[str, object]:
    done = _run(engine, cases)
    for i, case in enumerate(cases):
        out = done[str(i)]
        want = _expected(reference[i], case, set(engine.eos_token_ids))
        got = out.outputs[0].token_ids
        assert got == want, f"request {i} (prompt {len(case.prompt)} tokens) diverged"
        assert out.outputs[0].finish_reason == (
            "length"
            if len(want) == case.max_tokens
            and (case.ignore_eos or want[-1] not in engine.eos_token_ids)
            else "stop"
        )
    stats = engine.stats()
    assert stats.kv_blocks_used == 0, "every block is free once every request finished"
    assert stats.num_running == stats.num_waiting == 0
    # Each prompt counts once, however often its sequence was preempted and admitted again.
    assert stats.total_prompt_tokens == sum(len(case.prompt) for case in cases)
    assert stats.total_cached_tokens == sum(o.metrics.num_cached_tokens for o in done.values())
    return done


def test_default_config(model: dict) -> None:
    cases, ref = model["plain"]
    engine = Engine(model["path"])
    _check(engine, cases, ref)
    assert engine.stats().num_preemptions == 0


def test_preemption(model: dict) -> None:
    cases, ref = model["plain"]
    engine = Engine(model["path"], num_kv_blocks=40, max_num_seqs=64)
    _check(engine, cases, ref)
    assert engine.stats().num_preemptions > 0


def test_chunked_prefill(model: dict) -> None:
    cases, ref = model["plain"]
    engine = Engine(model["path"], max_num_batched_tokens=48, enable_prefix_caching=False)
    _check(engine, cases, ref)
    stats = engine.stats()
    assert stats.num_chunked_prefills > 0
    assert stats.total_cached_tokens == 0


def test_prefix_caching_shared_prefixes(model: dict) -> None:
    cases, ref = model["shared"]
    engine = Engine(model["path"])
    done = _check(engine, cases, ref)
    assert engine.stats().total_cached_tokens > 0
    assert sum(o.metrics.num_cached_tokens for o in done.values()) > 0


def test_prefix_caching_with_chunks_and_preemption(model: dict) -> None:
    """40 blocks of 16 tokens cannot hold every running sequence's prompt and output, so
    sequences are preempted and admitted again, reading their prefix back from the cache."""
    cases, ref = model["shared"]
    engine = Engine(model["path"], num_kv_blocks=40, max_num_batched_tokens=64, admission="fcfs")
    _check(engine, cases, ref)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.total_cached_tokens > 0
    assert stats.num_chunked_prefills > 0


@pytest.mark.parametrize("kind", ["onednn", "mkl", "batchd"])
def test_packed_float32_linears_and_the_decode_kernel(
    model: dict, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Which float32 packing pays is measured once per machine; forced to each here
    (``cpu_gemm``), with the compiled decode kernel and layer ops, the output is still
    generate()'s."""
    from engine.cpu import linear

    if kind not in linear.kinds_for(torch.float32):
        pytest.skip(f"this torch has no {kind} packed linear")
    cases, ref = model["plain"]
    engine = Engine(model["path"], dtype="float32", cpu_gemm=kind)
    runner = engine.runner
    assert runner.backend.kernel is not None
    if runner.lean is not None:  # llama: the compiled layer ops between the matmuls
        assert runner.lean.ops is not None or layer_ops() is None
    packed = [m for m in runner.base.modules() if isinstance(m, linear.PackedLinear)]
    assert packed and all(m.kind == kind for m in packed)
    assert isinstance(runner.lm_head, linear.PackedLinear) and runner.lm_head.kind == kind
    _check(engine, cases, ref)


def test_torch_attention_path(model: dict) -> None:
    """Without the compiled kernel (``cpu_kernels=False``, or no C compiler) decode rows take
    torch's SDPA, with the same output."""
    cases, ref = model["plain"]
    engine = Engine(model["path"], cpu_kernels=False)
    assert engine.runner.backend.kernel is None
    _check(engine, cases, ref)


@pytest.mark.parametrize("prefill_kernel", [True, False], ids=["prefill-kernel", "two-parts"])
def test_float32_prefill_chunks(model: dict, prefill_kernel: bool) -> None:
    """In float32 every prefill chunk attends in the compiled prefill kernel,
    its keys read in place through the block table; without the kernel, a chunk that continues
    its sequence (chunked prefill, a prefix-cache hit, a preempted sequence read back) attends
    its cached keys and its own apart, merged by their log-sum-exps (engine/attention/sdpa.py).
    Either way: generate()'s output."""
    for cases, ref, config in (
        (*model["plain"], {"max_num_batched_tokens": 48, "enable_prefix_caching": False}),
        (*model["shared"], {"num_kv_blocks": 40, "max_num_batched_tokens": 64}),
    ):
        engine = Engine(model["path"], dtype="float32", admission="fcfs", **config)
        backend = engine.runner.backend
        taken: list[tuple[bool, int]] = []  # (attended, first position) of each chunk sent
        if not prefill_kernel:
            backend.prefill = None
        elif backend.prefill is None:
            pytest.skip("no C compiler or no AVX-512 here: prefill chunks keep torch's operator")
        else:
            kernel = backend.prefill

            def counted(*args, kernel=kernel, taken=taken):  # type: ignore[no-untyped-def]
                done = kernel(*args)
                taken.append((done, args[5]))
                return done

            backend.prefill = counted
        _check(engine, cases, ref)
        assert engine.stats().num_chunked_prefills > 0
        if prefill_kernel:
            assert any(done and pos == 0 for done, pos in taken), taken  # a first chunk
            assert any(done and pos > 0 for done, pos in taken), taken  # a continued one
