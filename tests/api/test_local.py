"""``BATCHD_AUTH=off`` (every caller an admin) only where nobody else can reach the API: the app
refuses to start with it on an address other than loopback, and answers only connections that
arrive on a loopback address; unit tests, no socket is opened to another address."""

from __future__ import annotations

import pytest
from starlette.requests import HTTPConnection

from api.local import is_loopback, local_only
from core.settings import Settings


def _settings(**values) -> Settings:
    return Settings(database_url="sqlite://", broker_url="memory://", **values)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "::ffff:127.0.0.1", "localhost"]
)
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["", "0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", "testserver", None]
)
def test_other_addresses(host: str | None) -> None:
    assert not is_loopback(host)


def _connection(server: tuple[str, int] | None) -> HTTPConnection:
    return HTTPConnection({"type": "http", "server": server, "headers": []})


def test_local_only_by_setting_and_connection() -> None:
    unset, loopback, everywhere = (
        _settings(api_host=""), _settings(api_host="127.0.0.1"), _settings(api_host="0.0.0.0")
    )  # fmt: skip
    assert local_only(unset, _connection(("127.0.0.1", 8000)))
    assert local_only(loopback, _connection(("::1", 8000)))
    # A connection that arrived on another address proves the server is reachable from there,
    # whatever the setting says.
    assert not local_only(loopback, _connection(("10.1.2.3", 8000)))
    assert not local_only(unset, _connection(None))
    # Bound to every address: not local, even for a connection over loopback.
    assert not local_only(everywhere, _connection(("127.0.0.1", 8000)))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "api.internal"])
def test_auth_off_refuses_to_start_bound_beyond_loopback(host: str) -> None:
    from api.app import create_app

    with pytest.raises(RuntimeError, match="BATCHD_AUTH=off"):
        create_app(_settings(auth="off", api_host=host))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", ""])
def test_auth_off_starts_on_loopback(host: str) -> None:
    from api.app import create_app

    create_app(_settings(auth="off", api_host=host, metrics_enabled=False))
    create_app(_settings(api_host="0.0.0.0", metrics_enabled=False))  # auth on: anywhere


def test_auth_off_refuses_connections_that_are_not_local() -> None:
    """In-process, the connection's address is "testserver", not a loopback address."""
    from fastapi.testclient import TestClient

    from api.app import create_app

    with TestClient(create_app(_settings(auth="off", metrics_enabled=False))) as client:
        for path in ("/v1/files", "/ui", "/ui/data"):
            refused = client.get(path)
            assert refused.status_code == 403, (path, refused.text)
            assert refused.json()["error"]["code"] == "authentication_off_not_local"
