"""batchd's inference engine: continuous batching over Hugging Face causal LMs.

A leaf package: it imports torch and transformers only.
"""

from engine.admission.host import EngineHost
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
from engine.llm import LLM

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
