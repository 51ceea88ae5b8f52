"""What the engine hands back: per-request outputs, metrics, errors and engine statistics."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


class RequestError(ValueError):
    """A request that can never run (empty, too long for the model or the KV pool).

    Raised by ``Engine.add_request``; the engine and every other request carry on. ``code`` is a
    stable name for the reason (``context_length_exceeded``, ``kv_cache_too_small``,
    ``invalid_prompt``, ``duplicate_request_id``), for callers that map it to an API error.
    """

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine: gauges first, then counters since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens admitted
    num_preemptions: int = 0
    last_step_tokens: int = 0
    num_steps: int = 0
    total_step_time_s: float = 0.0
    total_forward_time_s: float = 0.0
    total_scheduled_tokens: int = 0
    total_running_seq_steps: int = 0
    total_prompt_tokens: int = 0
    total_cached_tokens: int = 0
    total_output_tokens: int = 0
    num_chunked_prefills: int = 0  # prefill chunks that stopped short of the prompt's end
    num_suspended: int = 0  # requests its caller took out to give their room to others
    num_grammar_masks: int = 0  # token masks computed for structured-output sequences
    total_grammar_mask_time_s: float = 0.0  # computing them (overlapped with the forward pass)
    total_grammar_wait_time_s: float = 0.0  # steps waiting for them after the forward pass
    num_loras_registered: int = 0  # LoRA adapters the engine knows (engine/lora)
    num_loras_resident: int = 0  # of them, loaded now (at most max_loras)
    num_lora_loads: int = 0  # adapters made resident, reloads after an eviction included
    num_lora_evictions: int = 0
    lora_memory_bytes: int = 0  # the resident adapters' prepared weights


@dataclass(slots=True)
class HostStats:
    """Engine stats plus the host's own counters, snapshotted between two steps."""

    engine: EngineStats | None
    pending: int  # in the host's queue, not yet handed to the engine
    in_flight: int  # handed to the engine, not finished
    submitted: int
    completed: int  # finished normally (stop or length)
    aborted: int
    failed: int  # RequestError, a step failure, or any other error set on the future
    step_errors: int
    steps: int  # engine steps run by this host
    suspended: int  # in-flight requests suspended for another tenant's share or urgent work
    mean_occupancy: float  # running sequences / max_num_seqs, averaged over this host's steps
    max_pending: int
    max_in_flight: int

    def as_dict(self) -> dict[str, Any]:
        """One flat dict: the engine's fields, then the host's (for JSON and logs)."""
        out: dict[str, Any] = {}
        if self.engine is not None:
            out.update(asdict(self.engine) if is_dataclass(self.engine) else vars(self.engine))
        for name in self.__slots__:
            if name != "engine":
                out[name] = getattr(self, name)
        return out


def aborted_output(
    request_id: str, prompt_token_ids: list[int], n: int, arrival_time: float
) -> RequestOutput:
    """The output of a request aborted before the engine reported anything for it: ``n``
    empty completions that finished with ``abort``."""
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(n)
        ],
        finished=True,
        metrics=RequestMetrics(arrival_time=arrival_time, finished_time=time.time()),
        error=None,
    )
