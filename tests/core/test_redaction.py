"""Credentials out of another server's text (``core.security.redaction``): the message stays
readable, every key, token and key fingerprint in it becomes ``[redacted]``."""

from __future__ import annotations

import pytest

from core.security.redaction import REDACTED, redact

SECRETS = {
    # OpenAI's words for a wrong key, whole and masked
    "Incorrect API key provided: sk-abc***xyz. You can find your API key at "
    "https://platform.openai.com/account/api-keys.": "sk-abc***xyz",
    "Incorrect API key provided: sk-proj-AbCdEf0123456789ghIJ.": "sk-proj-AbCdEf0123456789ghIJ",
    "invalid x-api-key sk-ant-api03-Zx9_yW8-vU7tS6rQ5pO4": "sk-ant-api03-Zx9_yW8-vU7tS6rQ5pO4",
    # a bearer credential quoted back, with or without its header name
    "header was Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc": "eyJhbGciOiJIUzI1NiJ9.e30.abc",
    "got bearer upstream-secret-key": "upstream-secret-key",
    "authorization=Basic dXNlcjpwYXNzd29yZA==": "dXNlcjpwYXNzd29yZA==",
    # a fingerprint of a key
    "key ...****abcd is not valid": "****abcd",
    "The key abc***xyz was revoked": "abc***xyz",
    # labelled values
    "api_key: 'hunter2hunter2' refused": "hunter2hunter2",
    "x-api-key=shortkey1 refused": "shortkey1",
    "password: letmein!": "letmein!",
    # long opaque tokens
    "token 0123456789abcdef0123456789abcdef01234567 expired": "0123456789abcdef0123456789abcdef",
    "credential aGVsbG8gd29ybGQgdGhpcyBpcyBhIHNlY3JldCB0b2tlbg== refused": "aGVsbG8gd29ybGQ",
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 is invalid": "hf_AbCdEf",
    "AKIAIOSFODNN7EXAMPLE is not allowed": "AKIAIOSFODNN7EXAMPLE",
}


@pytest.mark.parametrize("text", list(SECRETS))
def test_a_key_or_its_fingerprint_is_redacted(text: str) -> None:
    out = redact(text)
    assert SECRETS[text] not in out, out
    assert REDACTED in out


def test_the_message_around_it_stays() -> None:
    assert redact("Incorrect API key provided: sk-abc***xyz") == (
        "Incorrect API key provided: [redacted]"
    )
    assert redact("Authorization: Bearer sk-0123456789") == "Authorization: Bearer [redacted]"
    assert redact("key ...****abcd is not valid") == "key [redacted] is not valid"


@pytest.mark.parametrize(
    "text",
    [
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens",
        "Unexpected fields in the request: {'min_p'}",
        "The model meta-llama/Llama-3.1-8B-Instruct does not exist",
        "max_tokens must be at most 4096; the token limit is 8192 tokens",
        "Basic validation failed: messages[0].content must be a string",
        "temperature must be between 0 and 2 (got 3.5)",
    ],
)
def test_ordinary_errors_pass_unchanged(text: str) -> None:
    assert redact(text) == text
