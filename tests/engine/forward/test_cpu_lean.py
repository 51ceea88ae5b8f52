"""The lean Llama forward (engine/forward/llama.py) against the model's own forward: the same
logits on every step of a run with decodes, chunked prefill and prefix-cache hits; taken only
where the model is exactly transformers' Llama (the greedy oracle tests cover the output)."""

from __future__ import annotations

import random

import pytest
import torch

from core.llms.demo import build
from engine import Engine, SamplingParams
from engine.core.step import StepBatch
from engine.cpu.kernels import layer_ops


@pytest.fixture(scope="module")
def llama() -> str:
    return str(build("llama-tiny"))


def test_every_step_matches_the_models_own_forward(llama: str) -> None:
    engine = Engine(llama, dtype="float32", max_num_batched_tokens=96, max_num_seqs=8)
    runner = engine.runner
    lean = runner.lean
    assert lean is not None
    # float32: the compiled layer ops between the matmuls, where a C compiler builds them
    assert (lean.ops is not None) == (layer_ops() is not None)
    lean_forward = runner.eager_forward
    compared: list[tuple[int, int]] = []

    def both(batch: StepBatch) -> torch.Tensor:
        runner.lean = None
        try:
            # The model's own forward first: the lean one then writes the step's K/V last.
            want = lean_forward(batch)
        finally:
            runner.lean = lean
        got = lean_forward(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        compared.append((len(batch.ctx.decodes), len(batch.ctx.prefills)))
        return got

    runner.eager_forward = both  # type: ignore[method-assign]
    rng = random.Random(0)
    shared = [rng.randrange(3, 2000) for _ in range(40)]
    for i in range(10):
        own = [rng.randrange(3, 2000) for _ in range(rng.randint(1, 150))]
        prompt = shared + own if i % 2 else own
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(d and p for d, p in compared), "some step mixed decodes with a prefill chunk"
    assert engine.stats().total_cached_tokens > 0, "some prompt hit the prefix cache"


def test_without_the_layer_ops_too(llama: str) -> None:
    """Where the layer ops are not built (no compiler) the lean forward keeps torch's
    operators: the same logits as with them."""
    engine = Engine(llama, dtype="float32")
    runner = engine.runner
    assert runner.lean is not None
    if runner.lean.ops is None:
        pytest.skip("no C compiler here: the layer ops are not built")
    engine.add_request("a", list(range(3, 90)), SamplingParams(max_tokens=1, temperature=0.0))
    batch = runner.prepare(engine.scheduler.schedule())
    fused = runner.eager_forward(batch)
    runner.lean.ops = None
    torch.testing.assert_close(runner.eager_forward(batch), fused, rtol=1e-5, atol=1e-5)


def test_only_llama_takes_it() -> None:
    assert Engine(str(build("llama-tiny"))).runner.lean is not None
    assert Engine(str(build("qwen2-tiny"))).runner.lean is None
    assert Engine(str(build("llama-tiny")), cpu_kernels=False).runner.lean is None
