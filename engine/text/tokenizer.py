"""Tokenizer loading, chat templates and stop strings."""

from __future__ import annotations

import threading
from typing import Any

# transformers resolves its classes through a lazy module that is not safe for concurrent
# first imports (a thread may see ``cannot import name 'AutoTokenizer'`` while another one
# imports it), and loading a tokenizer imports its class on first use: one load at a time.
_load_lock = threading.Lock()


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of the model directory ``model``; thread-safe."""
    with _load_lock:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, ready for the assistant's turn.

    Rendered to text first and then encoded without extra special tokens: this gives plain
    ids whatever ``apply_chat_template`` returns in the installed transformers version, and
    does not add a BOS the template already wrote.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def find_stop(text: str, delta_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest ``delta_len`` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
