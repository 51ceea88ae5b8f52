"""Token counts of a batch's requests, by each model's own tokenizer, loaded at worker start."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import worker_ready

from core.batchfile.request import BatchRequest
from core.broker.queue import CONTROL_QUEUE
from core.llms import generation
from core.settings import get_settings
from worker.infra import REQUEST_ERRORS, runtime

logger = logging.getLogger(__name__)


class TokenCounter:
    """Estimates each request's tokens with the model's own tokenizer (no model weights), and
    sums the prompt tokens (what the batch holds against its tenant's enqueued-token limit);
    ``last_prompt`` is the prompt tokens of the request counted last."""

    def __init__(self, model_names: list[str]):
        self.model_names = set(model_names)
        self.prompt_tokens = 0
        self.last_prompt = 0
        self.last_ids: list[int] | None = None  # a generation request's prompt ids
        # ... also an upstream model's, when it has a local tokenizer (the prefix plan's)
        self.last_plan_ids: list[int] | None = None

    def __call__(self, req: BatchRequest) -> int:
        tok = runtime.tokenizer(req.model)
        context = runtime.context_length(req.model)
        self.last_ids = None
        self.last_plan_ids = None
        if tok is None:  # an upstream model without a local tokenizer: counted by size
            prompt_len = generation.approx_prompt_tokens(req)
            self.prompt_tokens += prompt_len
            self.last_prompt = prompt_len
            return generation.estimate_tokens(req, prompt_len, context)
        try:
            ids = generation.prompt_token_ids(tok, req)
        except REQUEST_ERRORS as exc:
            # It fails with an error line when its shard runs; here it holds no tokens.
            logger.warning("line %s cannot be tokenized (%s); counted as 0 tokens", req.line, exc)
            ids = []
        else:
            if req.kind != "embedding":  # the embedding engine frames each input itself
                self.last_plan_ids = ids
                if not runtime.is_upstream(req.model):
                    self.last_ids = ids
        prompt_len = len(ids)
        self.prompt_tokens += prompt_len
        self.last_prompt = prompt_len
        return generation.estimate_tokens(req, prompt_len, context)


@worker_ready.connect
def _load_tokenizers(sender: Any = None, **_: Any) -> None:
    """A control worker loads every served model's tokenizer (and context length) once, at
    start, in the background: a batch's first lines do not wait for it."""
    try:
        consumed = set(sender.app.amqp.queues.consume_from or ())
    except Exception:
        return
    if CONTROL_QUEUE not in consumed:
        return

    def load() -> None:
        loaded = []
        for model in get_settings().models:
            try:
                runtime.tokenizer(model)
                runtime.context_length(model)
                loaded.append(model)
            except Exception as exc:  # reported when a batch names the model
                logger.warning("could not load the tokenizer of %s yet: %s", model, exc)
        logger.info("tokenizers loaded for validation: %s", ", ".join(loaded) or "none")

    threading.Thread(target=load, name="batchd-tokenizer-loader", daemon=True).start()
