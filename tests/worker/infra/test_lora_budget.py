"""A model worker gives its base model's engine the adapters at load, so the memory their
resident set may take comes off the KV budget; an adapter the engine refuses is left out and
named, and the base and its other adapters still run (then registered one by one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testkit.builders.lines import MODEL


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> dict[str, Path]:
    from core.llms.demo import build
    from testkit.builders.lora import make_adapter

    base = build("llama-tiny")
    return {
        "ok-a": make_adapter(base, tmp_path / "a", rank=4, target_modules=["q_proj"], seed=1),
        "ok-b": make_adapter(base, tmp_path / "b", rank=8, target_modules=["v_proj"], seed=2),
        "wide": make_adapter(base, tmp_path / "w", rank=72, target_modules=["q_proj"], seed=3),
    }


@pytest.fixture
def configure(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, Path]], None]]:
    """Serve the tiny model with the given adapters of it (``lora:`` entries)."""
    from core.settings import get_settings
    from worker.infra import runtime

    def serve(adapters: dict[str, Path]) -> None:
        models = {MODEL: "demo:llama-tiny"}
        models.update({name: f"lora:{MODEL}?path={path}" for name, path in adapters.items()})
        monkeypatch.setenv("BATCHD_MODELS", json.dumps(models))
        get_settings.cache_clear()

    yield serve
    get_settings.cache_clear()
    runtime._refused_adapters.clear()


def test_adapters_given_at_load_come_off_the_kv_budget(
    adapter_dirs: dict[str, Path], configure: Callable[[dict[str, Path]], None]
) -> None:
    from core.llms.demo import build
    from worker.infra import runtime

    good = {k: v for k, v in adapter_dirs.items() if k != "wide"}
    configure(good)
    engine = runtime._load_engine(MODEL, build("llama-tiny"), {"dtype": "float32"})
    loras = engine.runner.loras
    assert set(loras.specs) == set(good)
    assert loras.budgeted and loras.reserved_bytes == loras.needed_bytes(loras.specs.values())
    assert loras.reserved_bytes > 0
    assert runtime.adapter_refusal("ok-a") is None


def test_a_refused_adapter_is_named_and_the_others_still_load(
    adapter_dirs: dict[str, Path], configure: Callable[[dict[str, Path]], None]
) -> None:
    from core.llms.demo import build
    from worker.infra import runtime

    configure(adapter_dirs)
    engine = runtime._load_engine(MODEL, build("llama-tiny"), {"dtype": "float32"})
    assert set(engine.runner.loras.specs) == {"ok-a", "ok-b"}
    refusal = runtime.adapter_refusal("wide")
    assert refusal is not None and "72" in refusal and "64" in refusal
