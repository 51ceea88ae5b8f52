"""Where the service may send its own HTTP requests (webhooks): public addresses only, unless
the operator allows a destination (``BATCHD_WEBHOOK_ALLOWED_HOSTS``).

A destination address must be globally routable (an IPv6 address that carries an IPv4 one is
judged by both). The rule is applied when a batch is created (:func:`url_problem`) and at each
delivery (:func:`resolve_checked`: every address the name resolves to is checked and the
connection pinned to one), so DNS rebinding cannot get through; docs/core.md says why. Pure
apart from the resolver, which callers may inject."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: ``resolver(host, port)`` -> the addresses a connection to ``host`` could go to.
Resolver = Callable[[str, int], Sequence[str]]

ALLOW_SETTING = "BATCHD_WEBHOOK_ALLOWED_HOSTS"
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_PRIVATE = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
#: IANA special-purpose blocks, listed so the rule does not depend on the Python release's
#: ``is_global`` (which has changed between releases).
_RESERVED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "192.0.0.0/24", "192.0.2.0/24", "198.18.0.0/15", "198.51.100.0/24",
        "203.0.113.0/24", "240.0.0.0/4", "100::/64", "2001::/23", "2001:db8::/32", "3fff::/20",
        "5f00::/16",
    )
)  # fmt: skip
#: One part of an ``inet_aton`` address: hex, octal (a leading 0) or decimal, ASCII only.
_IPV4_PART = re.compile(r"0[xX]([0-9a-fA-F]*)|(0[0-7]*)|([1-9][0-9]*)")
_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class DestinationRefused(ValueError):
    """A destination the rule refuses; the message names the address and the rule."""


@dataclass(frozen=True)
class AllowList:
    """The operator's exceptions to the rule: host names (exact, case-insensitive) and
    address ranges (a bare address is a range of one)."""

    names: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        names: set[str] = set()
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().strip("[]")
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if "/" in entry or not _is_host_name(entry):
                    raise ValueError(
                        f"{ALLOW_SETTING}: {raw!r} is neither a host name, an IP address nor "
                        "a CIDR range"
                    ) from None
                names.add(entry.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IPAddress) -> bool:
        candidates = [address, *_embedded_ipv4(address)]
        return any(
            a.version == net.version and a in net for a in candidates for net in self.networks
        )


def _is_host_name(value: str) -> bool:
    labels = value.rstrip(".").split(".")
    return all(
        0 < len(label) <= 63 and all(ch.isalnum() or ch in "-_" for ch in label) for label in labels
    )


def parse_ipv4_loose(host: str) -> ipaddress.IPv4Address | None:
    """``host`` read as an IPv4 address the way ``inet_aton`` (and so many resolvers and HTTP
    clients) reads it: one to four parts, each decimal, octal (``0`` prefix) or hex (``0x``),
    the last part filling the remaining bytes. None when it is not such an address."""
    parts = host.rstrip(".").split(".") if host else []
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        match = _IPV4_PART.fullmatch(part)
        if match is None:
            return None
        hexa, octal, decimal = match.groups()
        if hexa is not None:
            values.append(int(hexa or "0", 16))
        elif octal is not None:
            values.append(int(octal, 8))
        else:
            values.append(int(decimal))
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        return None
    number = last
    for index, value in enumerate(head):
        number += value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def parse_address(host: str) -> IPAddress | None:
    """The address ``host`` spells (an IPv6 literal, with or without brackets and zone, or an
    IPv4 address in any ``inet_aton`` spelling), else None for a host name."""
    text = host.strip("[]")
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            return None
    return parse_ipv4_loose(text)


def _embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, NAT64, 6to4, Teredo)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    packed = int(address)
    if address in _NAT64 or (packed >> 32 == 0 and packed > 1):  # NAT64, IPv4-compatible
        found.append(ipaddress.IPv4Address(packed & 0xFFFFFFFF))
    return found


def address_class(address: IPAddress) -> str | None:
    """The non-public class ``address`` is in ("loopback", "private", "link-local", …), or
    None for a globally routable unicast address."""
    embedded = _embedded_ipv4(address)
    for inner in embedded:
        if (kind := address_class(inner)) is not None:
            return kind
    if embedded and address.version == 6 and int(address) >> 32 in (0, 0xFFFF):
        return None  # IPv4-mapped or -compatible: the IPv4 address is the destination
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.version == 4 and address in _SHARED:
        return "shared (carrier-grade NAT)"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"
    if any(address in net for net in _PRIVATE if net.version == address.version):
        return "private"
    if (
        any(address in net for net in _RESERVED if net.version == address.version)
        or address.is_reserved
        or address.is_private
        or not address.is_global
    ):
        # Documentation, benchmarking, 0/8, 192.0.0/24, 240/4, ...: never a receiver.
        return "reserved"
    return None


def refusal(address: IPAddress, allow: AllowList, host: str) -> str | None:
    """Why a connection to ``address`` (for ``host``) is refused, or None when it is allowed."""
    if allow.allows_address(address):
        return None
    kind = address_class(address)
    if kind is None:
        return None
    shown = host if host.strip("[]") == str(address) else f"{host} ({address})"
    article = "an" if kind[0] in "aeiou" else "a"
    return (
        f"{shown} is {article} {kind} address; webhooks are delivered only to public "
        f"addresses unless the operator allows the destination in {ALLOW_SETTING}"
    )


def url_problem(url: str, allow: AllowList) -> str | None:
    """Why ``url`` (already a well-formed http(s) URL) is refused at create time, or None.
    Checks what the URL alone says: an address host, or a name that is local by definition;
    other names are checked after resolution, at delivery (:func:`resolve_checked`)."""
    host = urlsplit(url).hostname or ""
    if allow.allows_name(host):
        return None
    address = parse_address(host)
    if address is not None:
        return refusal(address, allow, host)
    name = host.lower().rstrip(".")
    if name in _LOCAL_NAMES or name.endswith(".localhost"):
        if any(allow.allows_address(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")):
            return None  # loopback is allowed; delivery checks what the name resolves to
        return (
            f"{host} is a loopback name; webhooks are delivered only to public addresses "
            f"unless the operator allows the destination in {ALLOW_SETTING}"
        )
    return None


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP), as the system resolver answers."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def resolve_checked(
    host: str, port: int, allow: AllowList, resolver: Resolver = system_resolver
) -> IPAddress:
    """Resolve ``host`` and return the address to connect to, after checking every address it
    resolves to: one refused address refuses the host (a resolver may answer differently
    on the next lookup, so any refused answer is treated as the answer). Raises
    :class:`DestinationRefused`, or ``OSError`` when the name does not resolve."""
    literal = parse_address(host)
    if literal is not None:
        addresses: list[IPAddress] = [literal]
    else:
        addresses = []
        for text in resolver(host.strip("[]"), port):
            address = parse_address(text)
            if address is None:
                raise OSError(f"the resolver answered {text!r} for {host}, not an address")
            addresses.append(address)
        if not addresses:
            raise OSError(f"{host} resolves to no address")
    if not allow.allows_name(host):
        for address in addresses:
            if (reason := refusal(address, allow, host)) is not None:
                raise DestinationRefused(reason)
    return addresses[0]
