"""Request dependencies as ``Annotated`` aliases, so route signatures stay one line."""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from api.errors import APIError
from api.limits import (
    Buckets,
    auth_enabled,
    open_buckets,
    rate_limit_per_minute,
    retry_after_header,
)
from api.local import local_only
from core.batches.priority import Priority
from core.database.auth import hash_key, lookup, lookup_hash
from core.database.sessions import new_session
from core.database.tables import ApiKey
from core.settings import Settings
from core.storage import open_storage
from core.storage.base import Storage

T = TypeVar("T")

DEFAULT_TENANT = "default"


# The dependencies that do no I/O are ``async def``: FastAPI runs a plain ``def`` one in its
# thread pool, a round trip between threads that costs more CPU than the work itself.


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """A session for the request; it connects on its first query (in the route's thread),
    and its close, which talks to the database, runs in the thread pool."""
    session = new_session(settings.database_url)
    try:
        yield session
    finally:
        await run_in_threadpool(_close, session)


def _close(session: Session) -> None:
    try:
        session.close()
    except DBAPIError:
        # The connection died under us (database restarted): the response is already
        # decided, so drop the connection from the pool instead of failing the request.
        session.invalidate()


SessionDep = Annotated[Session, Depends(get_session)]


def _per_app(request: Request, name: str, lock: threading.Lock, create: Callable[[], T]) -> T:
    """``app.state.<name>``, made by ``create`` on first use: once per app, however many
    requests arrive together."""
    state = request.app.state
    value = getattr(state, name, None)
    if value is None:
        with lock:
            value = getattr(state, name, None)
            if value is None:
                value = create()
                setattr(state, name, value)
    return value


_storage_lock = threading.Lock()


def get_storage(request: Request, settings: SettingsDep) -> Storage:
    """One storage backend per app, opened on first use."""
    return _per_app(
        request, "storage", _storage_lock,
        lambda: open_storage(settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url),
    )  # fmt: skip


StorageDep = Annotated[Storage, Depends(get_storage)]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the tenant their rows belong to, their key's id, and the key's defaults
    and entitlements for the batches it creates."""

    tenant: str = DEFAULT_TENANT
    #: What the rate limit counts against: the key's id (static keys: a digest of the key).
    key_id: str = "anonymous"
    webhook_url: str | None = None
    webhook_secret: str | None = None
    #: An admin key (``BATCHD_ADMIN_API_KEYS``, or authentication off): the dashboard shows it
    #: every tenant's batches, and it may create batches of any priority.
    admin: bool = False
    #: The highest batch priority the caller may ask for (the key's ``max_priority``).
    max_priority: str = Priority.NORMAL.value
    #: The shortest completion window, in seconds, the caller may ask for (the key's
    #: ``min_completion_window_s``; None: the server's minimum).
    min_completion_window_s: int | None = None


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _masked(key: str) -> str:
    return key[:3] + "*" * 8 + key[-4:] if len(key) > 8 else "*" * len(key)


def _identify(request: Request, settings: Settings, session: Session) -> Caller:
    if not auth_enabled(settings):
        return anonymous_admin(settings, request)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    presented = presented.strip()
    if not header and (api_key := request.headers.get("x-api-key", "").strip()):
        # Anthropic's SDK sends its key in x-api-key; the key is the same either way.
        scheme, presented = "bearer", api_key
    if scheme.lower() != "bearer" or not presented:
        raise _unauthorized(
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    return identify_throttled(request, settings, session, presented)


def anonymous_admin(settings: Settings, request: Request) -> Caller:
    """Who calls when authentication is off: an admin, but only over a connection that
    arrived on a loopback address of a server bound to loopback (see :mod:`api.local`)."""
    if not local_only(settings, request):
        raise APIError(
            403,
            "Authentication is off (BATCHD_AUTH=off), which is for a server reachable from "
            "this machine only, and this request did not come over a loopback address. "
            "Turn authentication on and use an API key.",
            code="authentication_off_not_local",
        )
    return Caller(admin=True, max_priority=Priority.HIGH.value)


def _matches_any(digest: str, keys: list[str]) -> bool:
    candidate = digest.encode("ascii")
    matched = False
    for key in keys:  # compare with every key: the time does not reveal which
        matched |= hmac.compare_digest(candidate, hash_key(key).encode("ascii"))
    return matched


def _static_caller(settings: Settings, digest: str) -> Caller | None:
    """The caller a static key (``BATCHD_ADMIN_API_KEYS``, ``BATCHD_API_KEYS``) stands for,
    by the key's SHA-256; None for other keys."""
    static_id = "static-" + digest[:16]
    if _matches_any(digest, settings.admin_api_keys):
        return Caller(key_id=static_id, admin=True, max_priority=Priority.HIGH.value)
    if _matches_any(digest, settings.api_keys):
        return Caller(key_id=static_id)
    return None


def _stored_caller(row: ApiKey) -> Caller:
    return Caller(
        tenant=row.tenant,
        key_id=row.id,
        webhook_url=row.webhook_url,
        webhook_secret=row.webhook_secret,
        max_priority=row.max_priority,
        min_completion_window_s=row.min_completion_window_s,
    )


def identify_key(settings: Settings, session: Session, presented: str) -> Caller:
    """The caller a presented key stands for (static, admin or stored), or a 401. Callers
    with a request use :func:`identify_throttled`."""
    caller = _static_caller(settings, hash_key(presented))
    if caller is not None:
        return caller
    row = lookup(session, presented)
    if row is None:
        raise _unauthorized(f"Incorrect API key provided: {_masked(presented)}.")
    return _stored_caller(row)


def identify_digest(settings: Settings, session: Session, digest: str) -> Caller | None:
    """The caller of the key whose SHA-256 is ``digest`` (what a dashboard session
    remembers), as long as that key is still valid; None otherwise."""
    caller = _static_caller(settings, digest)
    if caller is not None:
        return caller
    row = lookup_hash(session, digest)
    return None if row is None else _stored_caller(row)


_buckets_lock = threading.Lock()


_blocked: OrderedDict[str, float] = OrderedDict()  # client address -> blocked until
_blocked_lock = threading.Lock()
MAX_BLOCKED = 10_000


def _auth_throttled(address: str, per_minute: int, wait: float) -> APIError:
    return APIError(
        429,
        f"Too many wrong API keys from this address ({per_minute} a minute, "
        f"auth_failures_per_minute). Retry in {retry_after_header(wait)} s.",
        code="rate_limit_exceeded",
        headers={"Retry-After": retry_after_header(wait)},
    )


def identify_throttled(
    request: Request, settings: Settings, session: Session, presented: str
) -> Caller:
    """:func:`identify_key`, with each wrong key counted against the client's address: once
    it has spent ``auth_failures_per_minute``, the address gets 429, without its key being
    looked at, until its bucket has a token again (no guessing at line rate)."""
    per_minute = settings.auth_failures_per_minute
    address = request.client.host if request.client is not None else "unknown"
    now = time.monotonic()
    with _blocked_lock:
        until = _blocked.get(address, 0.0)
    if per_minute > 0 and until > now:
        raise _auth_throttled(address, per_minute, until - now)
    try:
        return identify_key(settings, session, presented)
    except APIError as refused:
        if refused.status_code == 401 and per_minute > 0:
            wait = rate_buckets(request, settings).take(f"authfail:{address}", per_minute)
            if wait > 0:
                with _blocked_lock:
                    _blocked[address] = now + wait
                    _blocked.move_to_end(address)
                    while len(_blocked) > MAX_BLOCKED:
                        _blocked.popitem(last=False)
                raise _auth_throttled(address, per_minute, wait) from None
        raise


def rate_buckets(request: Request, settings: Settings) -> Buckets:
    """The app's token buckets (Redis when the broker is Redis)."""
    return _per_app(
        request, "rate_buckets", _buckets_lock, lambda: open_buckets(settings.broker_url)
    )


def identify_and_limit(request: Request, settings: Settings, session: Session) -> Caller:
    """Require ``Authorization: Bearer <key>`` (a key from ``api_keys`` or a static
    ``BATCHD_API_KEYS`` key, whose tenant is ``default``) unless auth is switched off; then
    take one token from the key's rate-limit bucket."""
    caller = _identify(request, settings, session)
    per_minute = rate_limit_per_minute(settings)
    if per_minute > 0:
        wait = rate_buckets(request, settings).take(caller.key_id, per_minute)
        if wait > 0:
            raise APIError(
                429,
                f"Rate limit reached: {per_minute} requests per minute for this API key. "
                f"Retry in {retry_after_header(wait)} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after_header(wait)},
            )
    return caller


#: Where :func:`authenticate_request`'s caller is kept for the route (``request.state``).
CALLER_STATE = "caller"


def authenticate_request(request: Request, settings: Settings) -> Caller:
    """:func:`identify_and_limit` from the request's headers alone, on a session of its own
    (closed before returning): what :class:`api.gate.RequestGate` calls before any byte of the
    body is read."""
    session = new_session(settings.database_url)
    try:
        return identify_and_limit(request, settings, session)
    finally:
        _close(session)


async def authenticate(request: Request, settings: SettingsDep) -> Caller:
    """The caller :class:`api.gate.RequestGate` identified from the headers (and charged to its
    rate limit) before the body was read; in an app assembled without the gate, that check
    is made here."""
    caller = getattr(request.state, CALLER_STATE, None)
    if isinstance(caller, Caller):
        return caller
    return await run_in_threadpool(authenticate_request, request, settings)


CurrentKey = Annotated[Caller, Depends(authenticate)]


async def authenticate_then_release(caller: CurrentKey, session: SessionDep) -> Caller:
    """:func:`authenticate`, then the request's database connection goes back to the pool
    before the route reads its body: a slow upload (the client's pace) must not hold one
    (twenty trickling uploads emptied the pool, and every tenant's calls got 503). The
    session connects again if the route queries after the body."""
    await run_in_threadpool(_close, session)
    return caller


#: The caller of a route that streams a request body (uploads).
UploadingKey = Annotated[Caller, Depends(authenticate_then_release)]
