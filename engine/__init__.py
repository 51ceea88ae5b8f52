"""batchd's inference engine: continuous batching over Hugging Face causal LMs.

A leaf package: it imports torch and transformers only.
"""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.host import EngineHost
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
    "EngineHost",
    "EngineStats",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
