"""What ``/readyz`` asks: can this process reach its database, its broker and its storage?

Each check does one small round trip with a bounded wait and answers None (reachable) or the
reason it is not; a check never raises. Liveness (``/livez``) asks none of them: a database
blip must take pods out of the load balancer, not restart them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from sqlalchemy import text

from core.broker.queue import SOCKET_CONNECT_TIMEOUT_S, redis_socket_options
from core.database.sessions import get_engine
from core.storage.base import Storage

TIMEOUT_S = 3.0


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def database(url: str) -> str | None:
    try:
        with get_engine(url).connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as error:
        return _reason(error)
    return None


def broker(url: str) -> str | None:
    from kombu import Connection

    try:
        with Connection(
            url,
            connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
            transport_options=redis_socket_options(url, TIMEOUT_S),
        ) as connection:
            connection.ensure_connection(max_retries=1, timeout=TIMEOUT_S)
    except Exception as error:
        return _reason(error)
    return None


def storage(open_storage: Callable[[], Storage]) -> str | None:
    """Open the storage and write and delete a small object in it: a storage that can be read
    but not written is not ready for uploads or results."""
    key = f"readyz/{socket.gethostname()}-{os.getpid()}"
    try:
        store = open_storage()
        with store.writer(key) as out:
            out.write(b"ok")
        store.delete(key)
    except Exception as error:
        return _reason(error)
    return None


def failures(checks: dict[str, Callable[[], str | None]]) -> dict[str, str]:
    """The checks that failed, by name, with their reasons."""
    results = {name: check() for name, check in checks.items()}
    return {name: reason for name, reason in results.items() if reason is not None}
