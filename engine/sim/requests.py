"""What a simulated completion is: a pure function of its request, never of the batch it ran in.

Its length is ``max_tokens`` (clamped to ``max_model_len``) or, with ``lengths="hash"``, drawn
by a hash of the prompt; its tokens come from a fixed pseudo-random stream of ordinary word
tokens; logprobs are 0. Sampling options are accepted and ignored; the prompt is checked as the
real engine checks it (``RequestError``). In full: docs/engine.md ("The simulated engine").
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.core.sampling_params import SamplingParams

STREAM_LEN = 65521  # P: the token stream's period (a prime)
STREAM_SEED = 20240601
INDEX_STRIDE = 7919  # completion i starts i * 7919 tokens further along the stream
_M64 = (1 << 64) - 1


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request in the simulated engine (the handle ``suspend_request`` returns)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt_hash: int
    seqs: list[SimSeq] = field(default_factory=list)
    num_unfinished: int = 0
    admitted: bool = False  # its prompt was counted in the engine's prompt totals


@dataclass(slots=True, eq=False)
class SimSeq:
    """One completion. Its tokens in the current run are a range of virtual steps."""

    seq_id: int
    request: SimRequest
    index: int  # the completion's index in its request
    priority: int
    length: int  # the tokens it produces in all
    reason: str  # its finish_reason once it has them
    done: int = 0  # tokens produced before its current run (preemption, suspension)
    first: int = 0  # the virtual step of the current run's first token
    last: int = 0  # the virtual step of its final token
    epoch: int = 0  # bumped whenever it stops running: older index entries are stale
    status: str = "waiting"  # waiting, running, suspended, finished
    finish_reason: str | None = None
    num_tokens: int = 0  # tokens produced, once finished or aborted


class Completions:
    """The completions of every request over one tokenizer: their lengths, token ids, text and
    logprobs (module docstring). ``lengths`` is "max" or "hash"."""

    def __init__(self, tokenizer: Any, max_model_len: int, lengths: str) -> None:
        self.tokenizer = tokenizer
        self.lengths = lengths
        self._stream, self._text_of = token_stream(tokenizer, max_model_len)

    def length(self, h: int, index: int, params: SamplingParams, room: int) -> tuple[int, str]:
        """Completion ``index``'s length and finish reason, for a prompt of hash ``h`` with
        ``room`` tokens left under ``max_model_len``."""
        want = params.max_tokens
        reason = "length"
        if self.lengths == "hash" and not params.ignore_eos:
            drawn = 1 + mix(h ^ (index * 0x9E3779B97F4A7C15)) % want
            if drawn < want:
                want, reason = drawn, "stop"
        if want > room:
            return room, "length"
        return want, reason

    def output(self, request: SimRequest) -> RequestOutput:
        """The request's output, from the tokens each of its completions produced."""
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            ids = self.token_ids(request.prompt_hash, seq.index, seq.num_tokens)
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=self._text(ids),
                    token_ids=ids,
                    finish_reason=seq.finish_reason,  # type: ignore[arg-type]
                    stop_reason=None,
                    logprobs=self._logprobs(ids, request.params),
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=request.metrics,
        )

    def token_ids(self, prompt_hash: int, index: int, count: int) -> list[int]:
        """The first ``count`` output token ids of completion ``index`` of a prompt."""
        offset = (prompt_hash + index * INDEX_STRIDE) % STREAM_LEN
        return self._stream[offset : offset + count]

    def _text(self, ids: list[int]) -> str:
        if self._text_of is not None:
            return "".join(map(self._text_of.__getitem__, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _logprobs(self, ids: list[int], params: SamplingParams) -> list[TokenLogprob] | None:
        if not params.logprobs:
            return None
        k, stream = params.top_logprobs, self._stream
        return [
            TokenLogprob(
                t,
                0.0,
                [(t, 0.0)] + [(stream[(t + 31 * i) % STREAM_LEN], -10.0 * i) for i in range(1, k)]
                if k
                else [],
            )
            for t in ids
        ]


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prompt_hash(prompt: list[int]) -> int:
    data = array("q", prompt).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def token_stream(tokenizer: Any, max_len: int) -> tuple[list[int], dict[int, str] | None]:
    """A fixed pseudo-random stream of word tokens (``STREAM_LEN`` long, extended by
    ``max_len`` so that any window is one slice), and each token's text when the tokenizer
    decodes a run of them as the concatenation of their texts (else None: decode each
    output)."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    texts = {}
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        text = tokenizer.decode([token_id])
        if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            texts[token_id] = text
    pool = sorted(texts) or [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(STREAM_SEED)
    base = [rng.choice(pool) for _ in range(STREAM_LEN)]
    stream = (base * (1 + max_len // STREAM_LEN + 1))[: STREAM_LEN + max_len]
    probe = base[:64]
    table = texts if texts else None
    if table is not None and tokenizer.decode(probe, skip_special_tokens=True) != "".join(
        table[t] for t in probe
    ):
        table = None
    return stream, table
