"""Loading models in a model worker process (``worker.infra.runtime``, ``worker.shards.task``):
engines load one at a time, and a shard whose model cannot be loaded here is left for later,
unclaimed, instead of being run into errors."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import pytest

from testkit.builders.worker import (
    MODEL,
    batch_row,
    chat_line,
    read_file_lines,
    shard_rows,
    validated_batch,
)

pytestmark = pytest.mark.services


def test_two_models_never_load_at_the_same_time(worker_env, monkeypatch):
    """transformers' loading is process-global (meta-device initialisation): two models
    loading at once corrupt each other. Each load waits here until the other arrives or a
    few seconds pass, so loads that may overlap do."""
    import engine
    from core.llms.demo import build
    from core.settings import get_settings
    from worker.infra import runtime

    models = {"load-a": "demo:llama-tiny", "load-b": "demo:qwen2-tiny"}
    monkeypatch.setenv("BATCHD_MODELS", json.dumps(models))
    get_settings.cache_clear()
    for spec in models.values():
        build(spec.split(":", 1)[1])
    lock = threading.Lock()
    loading: list[int] = [0, 0]  # now, most at once
    both = threading.Barrier(2)
    real = engine.Engine

    class WatchedEngine(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with lock:
                loading[0] += 1
                loading[1] = max(loading)
            with contextlib.suppress(threading.BrokenBarrierError):
                both.wait(timeout=5)
            try:
                super().__init__(*args, **kwargs)
            finally:
                with lock:
                    loading[0] -= 1

    monkeypatch.setattr(engine, "Engine", WatchedEngine)
    errors: list[BaseException] = []

    def load(model: str) -> None:
        try:
            runtime.host(model)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(m,)) for m in models]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert set(runtime.loaded_hosts()) >= set(models)
        assert loading[1] == 1, "two models loaded at the same time"
    finally:
        for model in models:
            with runtime._lock:
                started = runtime._hosts.pop(model, None)
                runtime._context.pop(model, None)
            if started is not None:
                started.shutdown(wait=True, abort_pending=True, timeout=30)


def test_a_shard_whose_model_cannot_load_here_waits_unclaimed(worker_env, monkeypatch, host):
    """The model's files are refused in this process: the shard task gives up its turn
    (ModelUnavailable, retried later) without claiming the shard or spending an attempt, and
    once a worker has the model the batch completes with every request run."""
    from core.settings import get_settings
    from worker.batches.finalize import finalize
    from worker.infra import runtime
    from worker.shards.task import ModelUnavailable, ShardEnd, run_shard

    ids = [f"u{i}" for i in range(3)]
    batch_id = validated_batch([chat_line(c, f"hi {c}", max_tokens=3) for c in ids])
    (shard,) = shard_rows(batch_id)
    served = worker_env["BATCHD_MODELS"]
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({MODEL: "/nonexistent/model.gguf"}))
    get_settings.cache_clear()
    try:
        with pytest.raises(ModelUnavailable) as caught:
            run_shard(shard.id)
        assert MODEL in str(caught.value)
        (row,) = shard_rows(batch_id)
        assert (row.status, row.attempts) == ("pending", 0)
    finally:
        with runtime._lock:
            runtime._refused.pop(MODEL, None)
        monkeypatch.setenv("BATCHD_MODELS", served)
        get_settings.cache_clear()
    assert run_shard(shard.id, host=host).end == ShardEnd.DONE
    assert finalize(batch_id) == "completed"
    out = read_file_lines(batch_row(batch_id).output_file_id)
    assert [r["custom_id"] for r in out] == ids
