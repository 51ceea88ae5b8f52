"""A sequence's text, decoded a few tokens at a time as the engine generates them."""

from __future__ import annotations

from typing import Any

from engine.core.sequence import Sequence


def start_detokenizer(seq: Sequence) -> None:
    """Incremental decoding starts a few prompt tokens back, so a word that continues the
    prompt gets its leading space right."""
    seq.detok_read = seq.num_prompt_tokens
    seq.detok_prefix = max(seq.num_prompt_tokens - 5, 0)


def detokenize_step(tokenizer: Any, seq: Sequence) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.text``; return what was added.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """
    tokens = seq.token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(
        tokens[seq.detok_prefix : seq.detok_read], skip_special_tokens=skip
    )
    full = tokenizer.decode(tokens[seq.detok_prefix :], skip_special_tokens=skip)
    if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
        delta = full[len(prefix_text) :]
        seq.detok_prefix = seq.detok_read
        seq.detok_read = len(tokens)
        seq.text += delta
        return delta
    return ""
