"""The webhook destination rule as pure functions: URLs and addresses only, with an injected
resolver (no socket, no DNS, no request is ever made here)."""

from __future__ import annotations

import ipaddress

import pytest

from core.security.netcheck import (
    AllowList,
    DestinationRefused,
    address_class,
    parse_address,
    parse_ipv4_loose,
    resolve_checked,
    url_problem,
)
from core.settings import Settings

NOTHING = AllowList()


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.7.7.7", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("100.64.0.1", "shared (carrier-grade NAT)"),
        ("fec0::1", "site-local"),
        ("0.1.2.3", "reserved"),
        ("192.0.0.8", "reserved"),
        ("192.0.2.1", "reserved"),  # documentation
        ("198.18.0.1", "reserved"),  # benchmarking
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("2001:db8::1", "reserved"),  # documentation
        # IPv6 addresses carrying an IPv4 one are judged by it.
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:169.254.169.254", "link-local"),
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("64:ff9b::7f00:1", "loopback"),
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:c0a8:101::1", "private"),  # 6to4 of 192.168.1.1
    ],
)
def test_non_public_addresses_are_classified(address: str, kind: str) -> None:
    assert address_class(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert address_class(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    ("spelling", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("127.0.1", "127.0.0.1"),
        ("10.0x10.1", "10.16.0.1"),
        ("0", "0.0.0.0"),
        ("169.254.43518", "169.254.169.254"),
        ("127.0.0.1.", "127.0.0.1"),
    ],
)
def test_odd_ipv4_spellings_are_read_as_inet_aton_reads_them(spelling: str, address: str) -> None:
    assert parse_ipv4_loose(spelling) == ipaddress.IPv4Address(address)


@pytest.mark.parametrize(
    "host",
    [
        "example.com",
        "1.2.3.4.5",
        "256.1.1.1",
        "4294967296",
        "08.1.1.1",
        "1..1",
        "",
        "[::g]",
        "0x_1.0.0.1",
        "1_0.0.0.1",
        "\u0661\u0662\u0667.0.0.1",
        "+1.0.0.1",
        "0x-1",
    ],
)
def test_names_are_not_addresses(host: str) -> None:
    assert parse_address(host) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/hook",
        "http://127.7.7.7/",
        "http://localhost:9000/",
        "http://LOCALHOST./",
        "http://api.localhost/",
        "http://[::1]:8080/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:7f00:1]/",
        "http://2130706433/",
        "http://0x7f.1/",
        "http://127.1/",
        "http://0/",
        "http://0.0.0.0:80/",
        "https://10.0.0.5/hook",
        "https://192.168.0.10/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fe80::1%25eth0]/",
        "http://[fd12:3456::1]/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "http://100.64.1.1/",
        "http://user:pw@127.0.0.1/",
    ],
)
def test_create_time_check_refuses_non_public_urls(url: str) -> None:
    problem = url_problem(url, NOTHING)
    assert problem is not None and "BATCHD_WEBHOOK_ALLOWED_HOSTS" in problem, url


def test_the_refusal_names_the_address_and_the_rule() -> None:
    assert url_problem("http://2130706433/", NOTHING) == (
        "2130706433 (127.0.0.1) is a loopback address; webhooks are delivered only to public "
        "addresses unless the operator allows the destination in BATCHD_WEBHOOK_ALLOWED_HOSTS"
    )
    problem = url_problem("http://169.254.169.254/", NOTHING)
    assert problem is not None and problem.startswith("169.254.169.254 is a link-local address")


@pytest.mark.parametrize(
    "url", ["https://hooks.example.com/x", "http://93.184.216.34:8080/", "https://[2606:4700::1]/"]
)
def test_create_time_check_accepts_public_urls_and_names(url: str) -> None:
    assert url_problem(url, NOTHING) is None


def test_the_allow_list_admits_names_addresses_and_ranges() -> None:
    allow = AllowList.parse(["127.0.0.1", "10.20.0.0/16", "Hooks.Corp.", "[::1]"])
    assert url_problem("http://127.0.0.1:9/", allow) is None
    assert url_problem("http://[::ffff:127.0.0.1]:9/", allow) is None  # the same address
    assert url_problem("http://[::1]:9/", allow) is None
    assert url_problem("http://10.20.3.4/", allow) is None
    assert url_problem("http://hooks.corp/", allow) is None
    assert url_problem("http://127.0.0.2/", allow) is not None  # outside the /32
    assert url_problem("http://10.21.0.1/", allow) is not None
    assert url_problem("http://localhost/", allow) is None  # loopback is allowed
    assert url_problem("http://localhost/", AllowList.parse(["10.0.0.0/8"])) is not None


@pytest.mark.parametrize("entry", ["not a host", "10.0.0.0/33", "foo/24", "a..b"])
def test_bad_allow_list_entries_fail_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="BATCHD_WEBHOOK_ALLOWED_HOSTS"):
        Settings(webhook_allowed_hosts=entry)
    assert Settings(webhook_allowed_hosts="127.0.0.1, 10.0.0.0/8,hooks.corp").webhook_allow_list()


class FakeResolver:
    """A resolver answering from a table, recording the lookups."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in self.table:
            raise OSError(f"{host}: name does not resolve")
        return self.table[host]


@pytest.mark.parametrize(
    "answer",
    [
        ["10.0.0.7"],
        ["169.254.169.254"],
        ["127.0.0.1"],
        ["::1"],
        ["::ffff:192.168.0.1"],
        ["fe80::1%eth0"],
        ["93.184.216.34", "10.0.0.7"],  # one bad answer refuses the name
        ["2606:4700::1", "fd00::1"],
    ],
)
def test_delivery_check_refuses_a_name_resolving_to_a_non_public_address(answer: list[str]) -> None:
    resolver = FakeResolver({"rebind.example": answer})
    with pytest.raises(DestinationRefused, match="rebind.example .* address; webhooks"):
        resolve_checked("rebind.example", 443, NOTHING, resolver)
    assert resolver.calls == [("rebind.example", 443)]


def test_delivery_check_returns_the_checked_address() -> None:
    resolver = FakeResolver({"hooks.example": ["93.184.216.34", "2606:4700::1"]})
    address = resolve_checked("hooks.example", 443, NOTHING, resolver)
    assert address == ipaddress.ip_address("93.184.216.34")


def test_delivery_check_of_literals_skips_the_resolver() -> None:
    resolver = FakeResolver({})
    with pytest.raises(DestinationRefused, match="loopback"):
        resolve_checked("0x7f.1", 80, NOTHING, resolver)
    with pytest.raises(DestinationRefused, match="private"):
        resolve_checked("[::ffff:10.0.0.1]", 80, NOTHING, resolver)
    allow = AllowList.parse(["127.0.0.0/8"])
    assert resolve_checked("127.0.0.1", 80, allow, resolver) == ipaddress.ip_address("127.0.0.1")
    assert resolver.calls == []


def test_delivery_check_with_the_allow_list() -> None:
    resolver = FakeResolver({"hooks.corp": ["10.1.2.3"], "other.corp": ["10.9.9.9"]})
    by_name = AllowList.parse(["hooks.corp"])
    assert resolve_checked("hooks.corp", 80, by_name, resolver) == ipaddress.ip_address("10.1.2.3")
    with pytest.raises(DestinationRefused):
        resolve_checked("other.corp", 80, by_name, resolver)
    by_range = AllowList.parse(["10.9.0.0/16"])
    assert resolve_checked("other.corp", 80, by_range, resolver) == ipaddress.ip_address("10.9.9.9")


def test_unresolvable_names_are_an_error_not_a_refusal() -> None:
    with pytest.raises(OSError) as caught:
        resolve_checked("nowhere.example", 80, NOTHING, FakeResolver({}))
    assert not isinstance(caught.value, DestinationRefused)
    with pytest.raises(OSError, match="no address"):
        resolve_checked("empty.example", 80, NOTHING, FakeResolver({"empty.example": []}))
