"""Request dependencies as ``Annotated`` aliases, so route signatures stay one line."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.errors import APIError
from core.db import new_session
from core.settings import Settings
from core.storage import Storage, open_storage

DEFAULT_TENANT = "default"


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    session = new_session(settings.database_url)
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]

_storage_lock = threading.Lock()


def get_storage(request: Request, settings: SettingsDep) -> Storage:
    """One storage backend per app, opened on first use."""
    state = request.app.state
    storage = getattr(state, "storage", None)
    if storage is None:
        with _storage_lock:
            storage = getattr(state, "storage", None)
            if storage is None:
                storage = open_storage(
                    settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url
                )
                state.storage = storage
    return storage


StorageDep = Annotated[Storage, Depends(get_storage)]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the key they presented and the tenant their rows belong to."""

    key: str | None
    tenant: str = DEFAULT_TENANT


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _masked(key: str) -> str:
    return key[:3] + "*" * 8 + key[-4:] if len(key) > 8 else "*" * len(key)


def authenticate(request: Request, settings: SettingsDep) -> Caller:
    """Require ``Authorization: Bearer <key>`` when keys are configured; open otherwise."""
    if not settings.api_keys:
        return Caller(key=None)
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        raise _unauthorized(
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    candidate = presented.encode("utf-8", "surrogateescape")
    matched = False
    for key in settings.api_keys:  # compare with every key: the time does not reveal which
        matched |= hmac.compare_digest(candidate, key.encode("utf-8", "surrogateescape"))
    if not matched:
        raise _unauthorized(f"Incorrect API key provided: {_masked(presented)}.")
    return Caller(key=presented)


CurrentKey = Annotated[Caller, Depends(authenticate)]
