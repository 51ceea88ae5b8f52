"""Each tenant its own prefix cache on an upstream server (:mod:`worker.upstream.cache_salt`):
a keyed salt per tenant in the field the spec names, and a salt or key the tenant wrote mixed
into its own, so that it can never name another tenant's. (Against a real server:
tests/upstream/test_upstream_privacy.py; through a shard run:
tests/worker/upstream/test_upstream_line_limits.py.)"""

from __future__ import annotations

import hashlib

from core.batchfile.request import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL
from worker.upstream.cache_salt import salted_body, tenant_salt

KEY = b"k" * 32
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is my diagnosis?"}]}


def test_each_tenant_gets_its_own_salt_in_vllms_field() -> None:
    a = salted_body(BODY, url=CHAT_URL, tenant="a", key=KEY, salt_field="cache_salt")
    b = salted_body(BODY, url=CHAT_URL, tenant="b", key=KEY, salt_field="cache_salt")
    assert a["cache_salt"] != b["cache_salt"]
    assert a == dict(BODY, cache_salt=a["cache_salt"]) and "prompt_cache_key" not in a
    # the same tenant, the same salt (its lines share the cache), on every endpoint
    for url in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL):
        again = salted_body(BODY, url=url, tenant="a", key=KEY, salt_field="cache_salt")
        assert again["cache_salt"] == a["cache_salt"]
    assert BODY.get("cache_salt") is None  # the line's own body is left as it was


def test_a_salt_is_keyed_not_guessable_from_the_tenant() -> None:
    other_key = b"o" * 32
    assert tenant_salt(KEY, "a") != tenant_salt(other_key, "a")
    for guess in ("a", "tenant:a", '["a", null]'):
        assert tenant_salt(KEY, "a") != hashlib.sha256(guess.encode()).hexdigest()[:32]


def test_a_tenants_own_salt_cannot_name_another_tenants() -> None:
    b_salt = salted_body(BODY, url=CHAT_URL, tenant="b", key=KEY, salt_field="cache_salt")
    for field in ("cache_salt", "prompt_cache_key"):
        for flavour in ("cache_salt", "prompt_cache_key", "none"):
            # tenant a writes tenant b's salt (say it learnt it), or b's name, as its own
            for value in (b_salt["cache_salt"], "b", "tenant:b", ""):
                body = dict(BODY, **{field: value})
                sent = salted_body(body, url=CHAT_URL, tenant="a", key=KEY, salt_field=flavour)
                assert sent[field] != value
                assert sent[field] != b_salt["cache_salt"]
                assert sent[field] != tenant_salt(KEY, "b", [field, value])
    # a tenant may still split its own cache: two values, two salts, neither its default
    one = salted_body(dict(BODY, cache_salt="x"), url=CHAT_URL, tenant="a", key=KEY,
                      salt_field="cache_salt")  # fmt: skip
    two = salted_body(dict(BODY, cache_salt="y"), url=CHAT_URL, tenant="a", key=KEY,
                      salt_field="cache_salt")  # fmt: skip
    plain = salted_body(BODY, url=CHAT_URL, tenant="a", key=KEY, salt_field="cache_salt")
    assert len({one["cache_salt"], two["cache_salt"], plain["cache_salt"]}) == 3


def test_no_tenant_name_and_value_make_another_tenants_pair() -> None:
    """The (tenant, value) pair is encoded unambiguously: a separator in a name cannot shift
    the boundary between them."""
    assert tenant_salt(KEY, "a\0x", None) != tenant_salt(KEY, "a", "x\0")
    assert tenant_salt(KEY, 'a", "x', None) != tenant_salt(KEY, "a", "x")


def test_prompt_cache_key_goes_only_where_openais_schema_has_it() -> None:
    for url in (CHAT_URL, RESPONSES_URL):
        sent = salted_body(BODY, url=url, tenant="a", key=KEY, salt_field="prompt_cache_key")
        assert sent["prompt_cache_key"] == tenant_salt(KEY, "a") and "cache_salt" not in sent
    for url in (COMPLETIONS_URL, EMBEDDINGS_URL):  # a strict server refuses it there
        assert (
            salted_body(BODY, url=url, tenant="a", key=KEY, salt_field="prompt_cache_key") == BODY
        )
    assert salted_body(BODY, url=CHAT_URL, tenant="a", key=KEY, salt_field="none") == BODY
