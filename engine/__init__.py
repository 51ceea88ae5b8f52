"""batchd's inference engine: continuous batching over Hugging Face causal LMs.

A leaf package: it imports torch and transformers only. Its names load on first use, so that a
process that needs only the pure-Python parts (``engine.host.fair_queue``, the order every
dispatcher shares) starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.core.outputs",
    "Engine": "engine.core.engine",
    "EngineConfig": "engine.core.config",
    "EngineHost": "engine.host.host",
    "EngineStats": "engine.core.outputs",
    "RequestError": "engine.core.outputs",
    "RequestMetrics": "engine.core.outputs",
    "RequestOutput": "engine.core.outputs",
    "SamplingParams": "engine.core.sampling_params",
    "TokenLogprob": "engine.core.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineHost",
    "EngineStats",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from engine.core.outputs import (
        CompletionOutput,
        EngineStats,
        RequestError,
        RequestMetrics,
        RequestOutput,
        TokenLogprob,
    )
    from engine.core.sampling_params import SamplingParams
    from engine.host.host import EngineHost
    from engine.llm import LLM


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
