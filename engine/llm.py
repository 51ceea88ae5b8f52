"""The offline front end: ``LLM(model, **config).generate(prompts, params)`` (the vLLM shape)."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from engine.core.engine import Engine
from engine.core.outputs import RequestError, RequestMetrics, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.text.tokenizer import chat_prompt_ids

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int]
Conversation = list[dict]


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
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt the engine rejects gets a RequestOutput with ``error`` set and no outputs;
        the others still run. ``cache_salt``: these prompts share cached prefix blocks only
        with prompts generated under the same salt. ``lora``: the registered LoRA adapter
        every prompt runs with (``EngineConfig.lora_adapters``, ``Engine.add_lora``); an
        unknown name raises :class:`engine.lora.AdapterError` before anything runs.
        """
        if lora is not None:
            self.engine.runner.loras.check(lora)
        prompts = [prompts] if _one_prompt(prompts) else list(prompts)
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
                self.engine.add_request(request_id, ids, p, cache_salt=cache_salt, lora=lora)
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
                    slot = index.get(out.request_id)
                    if slot is not None:
                        results[slot] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        conversations: list[Conversation] | Conversation,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation (chat template applied)."""
        if _one_conversation(conversations):
            conversations = [conversations]
        prompts: list[Prompt] = [chat_prompt_ids(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt)


def _one_prompt(prompts: Prompt | list[Prompt]) -> TypeIs[Prompt]:
    """One prompt (text, or a non-empty list of token ids), not a list of them."""
    return isinstance(prompts, str) or (bool(prompts) and all(isinstance(t, int) for t in prompts))


def _one_conversation(conversations: list[Conversation] | Conversation) -> TypeIs[Conversation]:
    """One conversation (a non-empty list of messages), not a list of them."""
    return bool(conversations) and isinstance(conversations[0], dict)
