"""Per-request sampling parameters (OpenAI semantics), validated on construction."""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from engine.core.outputs import RequestError


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 turns top-k off; ``min_p`` (vLLM's and
    transformers') drops the tokens less likely than ``min_p`` times the likeliest, 0 turns it
    off. Presence and frequency penalties follow OpenAI: they apply to tokens already generated
    by this completion (not the prompt). ``repetition_penalty`` follows transformers (and
    vLLM): every token of the prompt or the output has its logit divided by it when positive,
    multiplied when negative; 1 turns it off. ``min_tokens``: no stop (end-of-sequence, stop
    token ids, stop strings) ends the completion before it holds that many tokens; the
    end-of-sequence and stop token ids cannot be sampled until then (transformers'
    ``min_new_tokens``). ``stop_token_ids`` end the completion like end-of-sequence does (the
    token is in ``token_ids``, not in the text). ``skip_special_tokens``: the text leaves out
    special tokens. ``n > 1`` forks the request after its prompt is computed; completion
    ``i`` samples with ``seed + i``.

    Structured output, one of (see ``engine.text.structured``): ``json_schema`` constrains the
    output to JSON valid against it (``{"type": "object"}``: any JSON object); ``regex`` to a
    match of the regular expression; ``choice`` to one of the strings.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(
                isinstance(s, str) and s for s in self.stop
            ):
                raise ValueError(
                    f"stop must be a non-empty string or a list of them, got {self.stop!r}"
                )
            if len(self.stop) > 16:
                raise ValueError(f"stop may hold at most 16 strings, got {len(self.stop)}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise ValueError(f"n must be an integer in [1, 128], got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(
                f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= float(value) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON object or None, got {self.json_schema!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string or None, got {self.regex!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"choice must be a non-empty list of non-empty strings or None, got {self.choice!r}"
            )
        kinds = [k for k in ("json_schema", "regex", "choice") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(
                f"at most one of json_schema, regex and choice may be set, got {kinds}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def structured(self) -> bool:
        """Whether a grammar constrains the output (``json_schema``, ``regex`` or ``choice``)."""
        return self.json_schema is not None or self.regex is not None or self.choice is not None


def check_new_request(
    request_id: str,
    prompt_token_ids: Iterable[int],
    params: SamplingParams | None,
    cache_salt: str | None,
    completion_index: int,
    live: Container[str],
    vocab_size: int,
    max_model_len: int,
) -> tuple[SamplingParams, list[int]]:
    """The refusals every engine makes before it runs a request (``RequestError`` naming the
    field): a bad completion index or cache salt, a request id already ``live``, an empty
    prompt, a token id outside ``[0, vocab_size)``, a prompt that leaves no room for output
    in ``max_model_len``. Returns the parameters (defaults when None) and the prompt as a
    list."""
    params = params or SamplingParams()
    if (
        isinstance(completion_index, bool)
        or not isinstance(completion_index, int)
        or not 0 <= completion_index < 128
        or (completion_index and params.n != 1)
    ):
        raise RequestError(
            f"request {request_id!r}: completion_index must be an integer in [0, 128) and "
            f"needs n == 1, got {completion_index!r} with n={params.n}",
            "invalid_request",
        )
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestError(
            f"request {request_id!r}: cache_salt must be a non-empty string or None, got {cache_salt!r}",
            "invalid_request",
        )
    if request_id in live:
        raise RequestError(
            f"request_id {request_id!r} is already in the engine", "duplicate_request_id"
        )
    prompt = list(prompt_token_ids)
    if not prompt:
        raise RequestError(
            f"request {request_id!r}: the prompt is empty; it needs at least 1 token",
            "invalid_prompt",
        )
    if not _token_ids_in(prompt, vocab_size):
        bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab_size)
        raise RequestError(
            f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})",
            "invalid_prompt",
        )
    if len(prompt) >= max_model_len:
        raise RequestError(
            f"request {request_id!r}: the prompt has {len(prompt)} tokens; max_model_len is "
            f"{max_model_len} and at least one token must be generated",
            "context_length_exceeded",
        )
    return params, prompt


def check_resume(request_id: str, live: Container[str], suspended: bool) -> None:
    """The refusals of putting back a suspended request (``RequestError``): its id is live
    again, or it was not suspended."""
    if request_id in live:
        raise RequestError(
            f"request_id {request_id!r} is already in the engine", "duplicate_request_id"
        )
    if not suspended:
        raise RequestError(f"request {request_id!r} is not suspended", "invalid_request")


def _token_ids_in(prompt: list[int], vocab_size: int) -> bool:
    """Whether every item is an int in ``[0, vocab_size)`` (min/max in C, not a loop here)."""
    try:
        return min(prompt) >= 0 and max(prompt) < vocab_size and set(map(type, prompt)) == {int}
    except TypeError:
        return False
