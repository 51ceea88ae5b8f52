"""Each tenant its own prefix cache on an upstream server, as on a local engine.

A server's prefix cache tells whoever reads ``cached_tokens`` (or times the first token) that a
prompt prefix was already seen. While ``share_prefix_cache_across_tenants`` is off, every line
sent to an upstream carries a salt derived from its tenant, in the field the spec names
(``cache_salt_field``): vLLM keeps a separate cache per ``cache_salt`` (the default); OpenAI-style
servers read ``prompt_cache_key`` (chat and responses only: their schemas have it, and a strict
server refuses a field it does not know, which is why both are never sent). A salt or key the
tenant wrote is not sent as written but mixed with the tenant, so a tenant can still split its
own cache but cannot name another tenant's.

A salt is an HMAC keyed with ``cache_salt_secret``: not guessable from the tenant's name, and
the same for every dispatch worker that shares the secret. Without one, each process draws its
own key: tenants stay apart, but a tenant's lines share the server's cache only within one
process and until it restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from typing import Any

from core.batchfile.request import CHAT_URL, RESPONSES_URL
from core.settings import Settings

logger = logging.getLogger(__name__)

#: The body fields that select a prefix cache on some server; a tenant's own value of either
#: is never sent as written.
SALT_FIELDS = ("cache_salt", "prompt_cache_key")
#: The endpoints whose OpenAI schema has ``prompt_cache_key``.
PROMPT_CACHE_KEY_URLS = (CHAT_URL, RESPONSES_URL)
SALT_HEX_CHARS = 32  # 128 bits

_process_key: bytes | None = None


def salt_key(settings: Settings) -> bytes:
    """The HMAC key: ``cache_salt_secret``, else one drawn for this process (said once)."""
    global _process_key
    if settings.cache_salt_secret:
        return settings.cache_salt_secret.encode()
    if _process_key is None:
        _process_key = secrets.token_bytes(32)
        logger.warning(
            "BATCHD_CACHE_SALT_SECRET is not set: this process salts each tenant's upstream "
            "prefix cache with a key of its own (tenants stay apart; a tenant's lines share the "
            "upstream's cache only within this process)"
        )
    return _process_key


def tenant_salt(key: bytes, tenant: str, value: Any = None) -> str:
    """The salt of ``tenant``'s lines that carry ``value`` in a salt field (None: none). The
    pair is encoded unambiguously (a JSON array), so no tenant name or value can make another
    tenant's pair."""
    message = json.dumps([tenant, value], ensure_ascii=False, sort_keys=True)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()[:SALT_HEX_CHARS]


def salted_body(
    body: dict[str, Any], *, url: str, tenant: str, key: bytes, salt_field: str
) -> dict[str, Any]:
    """``body`` with every salt field the tenant set replaced by its salt, and the tenant's
    salt in ``salt_field`` (``cache_salt``, ``prompt_cache_key`` or ``none``) where ``url``'s
    schema has that field."""
    out = dict(body)
    for name in SALT_FIELDS:
        if out.get(name) is not None:
            out[name] = tenant_salt(key, tenant, [name, out[name]])
    sets_field = salt_field == "cache_salt" or (
        salt_field == "prompt_cache_key" and url in PROMPT_CACHE_KEY_URLS
    )
    if sets_field and out.get(salt_field) is None:
        out[salt_field] = tenant_salt(key, tenant)
    return out
