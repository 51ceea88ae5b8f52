"""The LoRA oracle on a real model, SmolLM2-135M-Instruct in float32: chat prompts under two
adapters (attention only; attention and MLP) and the base, run together in one engine, each
line equal to peft's merged model with ``generate()`` alone, token for token, stopping at
the same end token. torch on one
thread, as in tests/engine/test_smollm2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, SamplingParams
from testkit.builders.lora import make_adapter

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
]
ADAPTERS = {
    "attn8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
    "all16": (16, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
}
LINES = [None, *ADAPTERS]
MAX_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def path(smollm2_one_thread: str) -> str:
    return smollm2_one_thread


@pytest.fixture(scope="module")
def adapters(path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        name: make_adapter(path, root / name, rank=rank, target_modules=targets, seed=seed)
        for name, (rank, targets, seed) in ADAPTERS.items()
    }


def test_mixed_batch(path: str, adapters: dict[str, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.text.tokenizer import chat_prompt_ids

    engine = Engine(path, lora_adapters={n: str(d) for n, d in adapters.items()})
    prompts = [
        chat_prompt_ids(
            engine.tokenizer,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )
        for question in QUESTIONS
    ]
    lines = [(prompt, lora) for prompt in prompts for lora in LINES]
    want: dict[int, list[int]] = {}
    for lora in LINES:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, str(adapters[lora])).merge_and_unload()
        model.eval()
        with torch.inference_mode():
            for i, (prompt, line_lora) in enumerate(lines):
                if line_lora != lora:
                    continue
                ids = torch.tensor([prompt])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=sorted(engine.eos_token_ids),
                    pad_token_id=min(engine.eos_token_ids),
                )
                want[i] = gen[0, len(prompt) :].tolist()
        del model

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, (prompt, lora) in enumerate(lines):
        engine.add_request(str(i), prompt, params, lora=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    tok = engine.tokenizer
    for i, (_, lora) in enumerate(lines):
        got = done[str(i)]
        assert got == want[i], (
            f"line {i} ({lora}): engine {tok.decode(got)!r} != generate() {tok.decode(want[i])!r}"
        )
    for k, lora in enumerate(LINES[1:], 1):  # each adapter changes some answer
        changed = [want[i] != want[i + k] for i in range(0, len(lines), len(LINES))]
        assert any(changed), f"adapter {lora} changes no answer"
    stats = engine.stats()
    assert stats.num_loras_resident == len(ADAPTERS) and stats.total_cached_tokens > 0
