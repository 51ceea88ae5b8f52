"""Structured output: decoding constrained by a JSON Schema, a regular expression or choices.

A request with ``json_schema``, ``regex`` or ``choice`` set gets an llguidance grammar matcher.
Its token mask is computed on llguidance's threads while the forward pass runs; the sampler
sees ``-inf`` for every forbidden token, and only constrained rows are masked. A closed value
allows only end-of-sequence ("stop"); ``max_tokens`` first gives "length". JSON is generated
compact. Why: docs/engine.md ("Structured output").
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # typed in the stub only, not exported

log = logging.getLogger("engine")

# JSON compiler options: compact output (see the module docstring).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_for(schema: dict[str, Any]) -> str:
    """The llguidance grammar of a JSON Schema (``{"type": "object"}``: any JSON object)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


# What regex syntax gives a meaning to (escaped, each stands for itself), and the control
# characters a pattern writes as escapes.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
_REGEX_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def regex_literal(text: str) -> str:
    """A regular expression that matches ``text`` and nothing else."""
    return "".join("\\" + ch if ch in _REGEX_META else _REGEX_CONTROL.get(ch, ch) for ch in text)


def grammar_of(params: Any) -> str:
    """The llguidance grammar of a request's structured output (``SamplingParams.json_schema``,
    ``regex`` or ``choice``)."""
    from llguidance import LLMatcher

    if params.json_schema is not None:
        return grammar_for(params.json_schema)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    return LLMatcher.grammar_from_regex("|".join(f"({regex_literal(c)})" for c in params.choice))


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why this schema cannot constrain decoding (an unsupported keyword, an invalid type), or
    None. Needs no tokenizer, so a request can be refused before any model is loaded."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_for(schema)
    except (ValueError, TypeError) as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


@dataclass(slots=True)
class PendingMasks:
    """Masks being computed for the rows ``rows`` of the step's sampling batch."""

    rows: list[int]
    bitmask: torch.Tensor
    future: Future[float]


class GrammarBackend:
    """The engine's grammar side: one tokenizer view for llguidance, one executor."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_id
        )
        self.executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._bits = torch.arange(32, dtype=torch.int32)
        self.mask_time_s = 0.0  # computing masks (overlapped with the forward pass)
        self.wait_time_s = 0.0  # the step waiting for masks after its forward pass
        self.num_masks = 0

    def matcher(self, params: Any) -> Any:
        """A fresh matcher for the structured output ``params`` (``SamplingParams``) ask for;
        ValueError naming the problem if it cannot be one."""
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar_of(params), log_level=0)
        if m.is_error():
            kind = "json_schema" if params.json_schema is not None else "regex"
            raise ValueError(f"{kind} cannot constrain decoding: {m.get_error()}")
        return m

    def start(self, seqs: list[Any]) -> PendingMasks | None:
        """Begin computing the masks of the constrained sequences among ``seqs`` (the step's
        sampling rows); None when there are none."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        from llguidance.torch import allocate_token_bitmask

        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)
        pairs = [(seqs[i].matcher, k) for k, i in enumerate(rows)]

        def compute() -> float:
            t0 = perf_counter()
            self.executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows)
            )
            return perf_counter() - t0

        self.num_masks += len(rows)
        return PendingMasks(rows, bitmask, self._pool.submit(compute))

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, pending: PendingMasks | None) -> torch.Tensor:
        """``logits`` (changed in place) with the forbidden tokens of the constrained rows set
        to ``-inf``."""
        if pending is None:
            return logits
        t0 = perf_counter()
        self.mask_time_s += pending.future.result()
        self.wait_time_s += perf_counter() - t0
        bits = pending.bitmask.unsqueeze(-1) >> self._bits & 1  # (rows, words, 32)
        allowed = bits.reshape(len(pending.rows), -1)[:, : logits.shape[1]].bool()
        if allowed.shape[1] < logits.shape[1]:  # a vocabulary wider than the tokenizer's
            pad = torch.zeros(len(pending.rows), logits.shape[1] - allowed.shape[1], dtype=bool)
            allowed = torch.cat([allowed, pad], dim=1)
        rows = torch.tensor(pending.rows, device=logits.device)
        # in place: the step's logits are read by nobody but the sampler
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def advance(self, seq: Any, token: int) -> bool:
        """Feed the sampled token to the sequence's matcher; True when the value is complete
        (the grammar stopped). A token the matcher refuses cannot be sampled under its mask,
        so a refusal is logged and ends the sequence."""
        m = seq.matcher
        if not m.consume_token(token):
            log.error("grammar refused sampled token %d: %s", token, m.get_error())
            return True
        return m.is_stopped()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
