"""Engines and sessions. One engine per process and URL; sessions are short-lived.

Engines are made through ``sqlalchemy.create_engine`` looked up at call time, so that traces
(:mod:`core.observability.tracing`, which wraps it) see the statements."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, cast

import sqlalchemy
from sqlalchemy import CursorResult, Delete, Engine, Update, event
from sqlalchemy.orm import Session, sessionmaker

from core.settings import get_settings


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    url = url or get_settings().database_url
    if url.startswith("sqlite"):
        from pathlib import Path

        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sqlalchemy.create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # WAL: readers never block the writer
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return sqlalchemy.create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)


@lru_cache
def _sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


def new_session(url: str | None = None) -> Session:
    return _sessionmaker(url)()


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = new_session(url)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def updated(session: Session, statement: Update | Delete) -> int:
    """Run an UPDATE or DELETE and return the number of rows it matched.

    ``Session.execute`` is typed as returning a plain ``Result``; a DML statement's is a
    ``CursorResult``, which has ``rowcount``."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount
