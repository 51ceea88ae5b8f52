"""Text from another server, with anything that looks like a credential taken out.

An upstream server's error message reaches the tenant whose line it refused, and some servers
quote the key they were sent ("Incorrect API key provided: sk-abc***xyz"): the operator's key,
or enough of it to recognise it. :func:`redact` keeps the message and replaces every API key,
bearer token, key fingerprint and long opaque token in it with ``[redacted]``.
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"

_TOKEN = r"[A-Za-z0-9+/_\-]"
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # An authorization scheme and its credential.
    (re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9+/_\-.~=*]{6,}"), rf"\1 {REDACTED}"),
    (
        re.compile(r"(?i)\b(basic)\s+(?=[A-Za-z0-9+/]*[0-9+/=])[A-Za-z0-9+/]{8,}={0,2}"),
        rf"\1 {REDACTED}",
    ),
    # A label that says a secret follows: the label stays, the value goes.
    (
        re.compile(
            r"(?i)(\b(?:api[ _-]?key|x-api-key|key provided|access[ _-]?token|token|secret"
            r"|password|authorization)\s*[:=]\s*)(['\"]?)(?!(?i:bearer|basic)\s|\[)[^\s'\",;}]+"
        ),
        rf"\1\2{REDACTED}",
    ),
    # OpenAI- and Anthropic-style keys (sk-…, sk-proj-…, sk-ant-…), whole or masked.
    (re.compile(r"\bsk-[A-Za-z0-9_\-.*]{3,}"), REDACTED),
    # AWS access key ids.
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    # A fingerprint: a masked key such as ...****abcd or abc***xyz.
    (re.compile(r"[^\s'\",;:()\[\]{}]*\*{3,}[^\s'\",;:()\[\]{}]*"), REDACTED),
    # Long hex, and long base64 or URL-safe tokens holding both letters and digits.
    (re.compile(r"\b[0-9a-fA-F]{32,}\b"), REDACTED),
    (
        re.compile(
            rf"(?<!{_TOKEN})(?=(?:{_TOKEN})*[0-9])(?=(?:{_TOKEN})*[A-Za-z]){_TOKEN}{{32,}}={{0,2}}"
        ),
        REDACTED,
    ),
)


def redact(text: str) -> str:
    """``text`` with each credential-like part replaced by ``[redacted]`` (see the module)."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
