"""The offline front end: ``LLM(model, **config).generate(prompts, params)`` (the vLLM shape)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from engine.core.engine import Engine
from engine.core.outputs import RequestError, RequestMetrics, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.text.tokenizer import chat_prompt_ids

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **config: Any) -> None:
        self.engine = Engine(model, **config)
        self.tokenizer = self.engine.tokenizer
        self._batch_ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt the engine rejects gets a RequestOutput with ``error`` set and no outputs;
        the others still run. ``cache_salt``: these prompts share cached prefix blocks only
        with prompts generated under the same salt.
        """
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one each"
            )
        batch = next(self._batch_ids)
        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"{batch}-{i}"
            try:
                self.engine.add_request(request_id, ids, p, cache_salt=cache_salt)
            except RequestError as exc:
                results[i] = RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=ids,
                    outputs=[],
                    finished=True,
                    metrics=RequestMetrics(arrival_time=time.time()),
                    error=str(exc),
                )
                continue
            index[request_id] = i
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(index), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    i = index.get(out.request_id)
                    if i is not None:
                        results[i] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        conversations: list[list[dict]] | list[dict],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation (chat template applied)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [chat_prompt_ids(self.tokenizer, conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt)
