"""Tokens and text: tokenizer loading, chat prompts, detokenization, grammar-constrained output."""
