"""Turns a step's logits into next tokens (and logprobs), batched over sequences.

Per row, in vLLM's order: penalties, the ``min_tokens`` mask (not on structured-output rows),
temperature, min-p/top-k/top-p truncation, sampling. Logprobs are taken before truncation.
Sampling takes ``argmax(p / E)`` for exponential noise ``E``; a seeded sequence draws from its
own generator, so its tokens do not depend on its batch. In full: docs/engine.md ("Sampling").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.outputs import TokenLogprob
from engine.core.sequence import Sequence

Argmax = Callable[[torch.Tensor], torch.Tensor]


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` (rows) with ``-inf`` for each token whose probability is below ``min_p``
    (one per row; 0 keeps every token) times the row's likeliest token's: transformers'
    ``MinPLogitsWarper``. The likeliest token always stays."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def repetition_penalty_(row: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """Penalise, in place, each token of ``token_ids`` in one row of logits: a positive logit
    divided by ``penalty``, a negative one multiplied (transformers'
    ``RepetitionPenaltyLogitsProcessor``, which vLLM follows)."""
    ids = torch.tensor(token_ids, device=row.device)
    ids = ids[ids < row.shape[0]]
    score = row.gather(0, ids)
    row.scatter_(0, ids, torch.where(score < 0, score * penalty, score / penalty))


class Sampler:
    def __init__(
        self,
        seed: int,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
        argmax: Argmax | None = None,
    ) -> None:
        """``argmax``: a faster ``argmax(dim=-1)`` of contiguous float32 rows on the CPU (the
        compiled one of engine/cpu/kernels.py), used for an all-greedy step's logits."""
        self.device = device
        self.argmax = argmax
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids = eos_token_ids  # masked with stop token ids below min_tokens

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        params = [s.params for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]
        want_logprobs = any(p.logprobs for p in params)
        penalized = [
            i
            for i, p in enumerate(params)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        ]
        held = [
            i
            for i, s in enumerate(seqs)
            if s.num_output_tokens < s.params.min_tokens and s.matcher is None
        ]
        if all(greedy) and not penalized and not held and not want_logprobs:
            return self._greedy(logits).tolist(), None

        if penalized or held:
            logits = logits.clone()
        vocab = logits.shape[1]
        for i in penalized:
            p = params[i]
            if p.repetition_penalty != 1.0:
                repetition_penalty_(logits[i], seqs[i].token_ids, p.repetition_penalty)
            out = seqs[i].output_token_ids
            if not out or not (p.presence_penalty or p.frequency_penalty):
                continue
            counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[
                :vocab
            ]
            counts = counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                logits.dtype
            )
        for i in held:
            p = params[i]
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops |= self.eos_token_ids
            banned = sorted(t for t in stops if t < vocab)
            if banned:
                logits[i, banned] = float("-inf")
        if not all(greedy):
            temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
            logits = logits / temps.unsqueeze(1)
        tokens = logits.argmax(dim=-1)
        sample_idx = [i for i, g in enumerate(greedy) if not g]
        if sample_idx:
            tokens[sample_idx] = self._sample(logits[sample_idx], [seqs[i] for i in sample_idx])
        token_list = tokens.tolist()
        if not want_logprobs:
            return token_list, None
        logprobs = torch.log_softmax(logits, dim=-1)
        entries: list[TokenLogprob | None] = []
        for i, p in enumerate(params):
            if not p.logprobs:
                entries.append(None)
                continue
            row = logprobs[i]
            top: list[tuple[int, float]] = []
            if p.top_logprobs:
                values, ids = row.topk(p.top_logprobs)
                top = list(zip(ids.tolist(), values.tolist(), strict=True))
            entries.append(TokenLogprob(token_list[i], float(row[token_list[i]]), top))
        return token_list, entries

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        argmax = self.argmax
        if (
            argmax is not None
            and logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.dim() == 2
            and logits.stride(1) == 1
        ):
            return argmax(logits)
        return logits.argmax(dim=-1)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        if any(p.min_p for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            logits = min_p_filter(logits, min_p)
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
            cut = rank >= torch.tensor(top_k, device=logits.device).unsqueeze(1)
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each token
            cut |= before > torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(
                1
            )
            cut[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = []
        for j, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[j].exponential_(generator=seq.generator)
            else:
                shared.append(j)
        if shared:
            noise[shared] = torch.empty(len(shared), vocab, device=probs.device).exponential_(
                generator=self.generator
            )
        return (probs / noise).argmax(dim=-1)
