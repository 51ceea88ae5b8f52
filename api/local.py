"""Whether the API is reachable only from this machine.

Two things decide it: ``BATCHD_API_HOST``, the address uvicorn was told to bind (when the
operator set it), and each connection's local address (ASGI's ``scope["server"]``): a
connection that arrived on an address other than loopback proves the server is reachable from
the network, whatever the setting says. The request's scheme says nothing here: behind a TLS
proxy it is ``http``.

Authentication off (``BATCHD_AUTH=off``) is refused unless the API is local only, and the
dashboard's cookies are ``Secure`` unless it is.
"""

from __future__ import annotations

import ipaddress

from starlette.requests import HTTPConnection

from core.settings import Settings


def is_loopback(host: str | None) -> bool:
    """``127.0.0.0/8``, ``::1`` (also IPv4-mapped) and ``localhost``; anything else, a name or
    a path included, is not."""
    if not host:
        return False
    host = host.strip().removeprefix("[").removesuffix("]").split("%", 1)[0]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def bound_beyond_loopback(settings: Settings) -> bool:
    """``BATCHD_API_HOST`` is set to an address other than loopback (``0.0.0.0``, say)."""
    return bool(settings.api_host.strip()) and not is_loopback(settings.api_host)


def local_only(settings: Settings, connection: HTTPConnection) -> bool:
    """True when, as far as this server can tell, only this machine reaches it: the bind
    setting (when set) is loopback, and this connection arrived on a loopback address."""
    if bound_beyond_loopback(settings):
        return False
    server = connection.scope.get("server")
    return server is not None and is_loopback(str(server[0]))


def check_auth_off_is_local(settings: Settings, auth_enabled: bool) -> None:
    """Refuse to start with authentication off on an address other than loopback."""
    if not auth_enabled and bound_beyond_loopback(settings):
        raise RuntimeError(
            f"BATCHD_AUTH=off makes every caller an admin; it is for a server bound to a "
            f"loopback address only, and BATCHD_API_HOST is {settings.api_host!r}. Turn "
            "authentication on (API keys: `batchd keys create`) or bind to 127.0.0.1."
        )
