"""API keys: generated here, stored only as their SHA-256, shown once at creation.

A key is ``sk-bd-`` and 256 random bits, so a fast hash is enough (docs/core.md). Each key
belongs to a tenant, which owns every file and batch created with it; it carries the highest
priority its batches may ask for (``max_priority``, ``normal`` unless granted more) and a
webhook secret (``whsec_…``) that signs their deliveries."""

from __future__ import annotations

import base64
import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from core.batches.priority import Priority
from core.database.lifecycle import now
from core.database.tables import ApiKey, UiSession

KEY_PREFIX = "sk-bd-"
#: How much of a key listings show: enough to tell keys apart, far too little to guess one.
SHOWN_PREFIX_CHARS = 12
WEBHOOK_SECRET_PREFIX = "whsec_"
#: ``last_used_at`` is written at most this often per key, so busy keys cost no write per call.
TOUCH_INTERVAL = timedelta(minutes=1)
MAX_TENANT_CHARS = 64
MAX_NAME_CHARS = 256
DEFAULT_MAX_PRIORITY = Priority.NORMAL.value


def priority_allowed(requested: str, maximum: str) -> bool:
    """Whether a key whose highest priority is ``maximum`` may ask for ``requested`` (a name
    that is not a priority is a ValueError)."""
    return Priority(maximum).allows(Priority(requested))


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8", "surrogateescape")).hexdigest()


def generate_key() -> tuple[str, str]:
    """A new key and its hash: ``("sk-bd-…", sha256 hex)``."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    return plaintext, hash_key(plaintext)


def generate_webhook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` and 32 random bytes in base64."""
    return WEBHOOK_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def key_id() -> str:
    return f"key_{secrets.token_hex(8)}"


def create_key(
    session: Session,
    tenant: str,
    name: str = "",
    *,
    webhook_url: str | None = None,
    max_priority: str = DEFAULT_MAX_PRIORITY,
    min_completion_window_s: int | None = None,
) -> tuple[ApiKey, str]:
    """Add a key for ``tenant`` (flushed, not committed) and return it with its plaintext,
    which is not stored anywhere: show it to the user now or never. Batches created with it
    may ask for priorities up to ``max_priority`` and completion windows of at least
    ``min_completion_window_s`` seconds (None: any the server accepts)."""
    if max_priority not in set(Priority):
        raise ValueError(f"a priority is one of {', '.join(Priority)}, got {max_priority!r}")
    if min_completion_window_s is not None and min_completion_window_s < 1:
        raise ValueError(
            f"a shortest completion window is at least 1 second, got {min_completion_window_s}"
        )
    tenant = tenant.strip()
    if not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise ValueError(f"a tenant is 1 to {MAX_TENANT_CHARS} characters, got {len(tenant)}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a key name is at most {MAX_NAME_CHARS} characters, got {len(name)}")
    plaintext, digest = generate_key()
    row = ApiKey(
        id=key_id(),
        tenant=tenant,
        name=name,
        key_hash=digest,
        prefix=plaintext[:SHOWN_PREFIX_CHARS],
        created_at=now(),
        webhook_url=webhook_url,
        webhook_secret=generate_webhook_secret(),
        max_priority=max_priority,
        min_completion_window_s=min_completion_window_s,
    )
    session.add(row)
    session.flush()
    return row, plaintext


def revoke_key(session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key (flushed, not committed); None when there is no such key. Revoking a
    revoked key keeps its first revocation time."""
    row = session.get(ApiKey, key_id)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = now()
        session.flush()
    return row


def lookup(session: Session, plaintext: str) -> ApiKey | None:
    """The live key whose hash matches ``plaintext``; None for unknown or revoked keys.

    Records the use in ``last_used_at`` when the last record is over a minute old, with one
    conditional UPDATE (concurrent requests write it once) that is committed here, so the
    record survives requests that only read.
    """
    if not plaintext.startswith(KEY_PREFIX):
        return None
    return lookup_hash(session, hash_key(plaintext))


def lookup_hash(session: Session, digest: str) -> ApiKey | None:
    """:func:`lookup` by the key's SHA-256 (what a dashboard session remembers)."""
    row = session.scalars(select(ApiKey).where(ApiKey.key_hash == digest)).first()
    if row is None or row.revoked_at is not None:
        return None
    current = now()
    last = row.last_used_at
    if last is None or current - last >= TOUCH_INTERVAL:
        session.execute(
            update(ApiKey)
            .where(
                ApiKey.id == row.id,
                or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < current - TOUCH_INTERVAL),
            )
            .values(last_used_at=current)
            .execution_options(synchronize_session=False)
        )
        session.commit()
        set_committed_value(row, "last_used_at", current)
    return row


def list_keys(session: Session, tenant: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    return list(session.scalars(query))


# -- dashboard sessions


def create_ui_session(session: Session, key_digest: str, ttl: timedelta) -> str:
    """Start a dashboard session for the key whose SHA-256 is ``key_digest`` (flushed, not
    committed) and return its token, for the browser's cookie; only the token's SHA-256 is
    stored. Sessions that have expired are deleted first, so the table holds only live ones."""
    current = now()
    session.execute(delete(UiSession).where(UiSession.expires_at <= current))
    token = secrets.token_urlsafe(32)
    session.add(
        UiSession(
            id=hash_key(token), key_hash=key_digest, created_at=current, expires_at=current + ttl
        )
    )
    session.flush()
    return token


def ui_session_key(session: Session, token: str) -> tuple[str, datetime] | None:
    """The SHA-256 of the key a live dashboard session signed in with, and when the session
    expires; None for unknown or expired tokens."""
    row = session.get(UiSession, hash_key(token))
    if row is None or row.expires_at <= now():
        return None
    return row.key_hash, row.expires_at


def end_ui_session(session: Session, token: str) -> None:
    """End a dashboard session (flushed, not committed); nothing when there is none."""
    session.execute(delete(UiSession).where(UiSession.id == hash_key(token)))
    session.flush()


MAX_WEBHOOK_URL_CHARS = 2048


def is_text(value: str) -> bool:
    """False for strings with lone surrogates, which no database text column accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def webhook_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a webhook target (an absolute http/https URL with a host), or
    None when it can."""
    from urllib.parse import urlsplit

    if len(url) > MAX_WEBHOOK_URL_CHARS:
        return f"is {len(url)} characters; the maximum is {MAX_WEBHOOK_URL_CHARS}"
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        return "must not contain whitespace or control characters"
    if not is_text(url):
        return "is not valid Unicode text"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme.lower() not in {"http", "https"}:
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "must name a host"
    return None
