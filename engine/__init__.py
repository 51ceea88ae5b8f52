"""batchd's inference engine: continuous batching over Hugging Face causal LMs.

A leaf package: it imports torch and transformers only.
"""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestError,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]

try:
    from engine.host import EngineHost  # noqa: F401

    __all__.append("EngineHost")
except ImportError:
    pass
