"""Turns a step's logits into next tokens (and logprobs), batched over sequences.

Order of operations per row: presence/frequency penalties over the tokens this completion has
generated (OpenAI semantics), temperature, then top-k and top-p truncation, then sampling.
Logprobs are the log-softmax of the logits after penalties and temperature, before top-k/top-p
truncation (greedy rows: temperature 1), so alternatives outside the top-p set stay finite.

Sampling draws exponential noise ``E`` and takes ``argmax(p / E)``, which samples from ``p``.
A sequence with a seed draws its noise from its own generator, so the same seed yields the same
tokens whatever batch the sequence runs in; sequences without a seed share the engine's.
"""

from __future__ import annotations

import torch

from engine.core.outputs import TokenLogprob
from engine.core.sequence import Sequence


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        params = [s.params for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]
        want_logprobs = any(p.logprobs for p in params)
        penalized = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if all(greedy) and not penalized and not want_logprobs:
            return logits.argmax(dim=-1).tolist(), None

        if penalized:
            logits = logits.clone()
            vocab = logits.shape[1]
            for i in penalized:
                out = seqs[i].output_token_ids
                if not out:
                    continue
                counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[
                    :vocab
                ]
                counts = counts.to(logits.dtype)
                p = params[i]
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    logits.dtype
                )
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
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
