"""A webhook receiver that trickles its answer a byte at a time, or a name server that answers
slowly, cannot hold a webhook thread: an attempt's timeout bounds the whole attempt, from
resolving the host to the last byte read, not each step."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from core.security.netcheck import AllowList
from worker.batches.webhooks import post_pinned

TRICKLE_S = 30.0  # how long the receiver would keep an attempt alive, a byte every 0.2 s


@pytest.fixture
def trickler() -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                answer = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000
                ends = time.monotonic() + TRICKLE_S
                for byte in answer:
                    if stop.is_set() or time.monotonic() > ends:
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.2)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    listener.close()


def _post(url: str, timeout: float, **kwargs: object) -> tuple[int, str]:
    return post_pinned(
        url,
        b"{}",
        {"content-type": "application/json"},
        timeout=timeout,
        allow=AllowList.parse(["127.0.0.1"]),
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_trickling_receiver_is_cut_off_at_the_attempts_timeout(trickler: int) -> None:
    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException, match="within 1 s"):
        _post(f"http://127.0.0.1:{trickler}/hook", 1.0)
    # Bounded by the attempt's timeout, not by the receiver (which would go on for 30 s).
    assert time.monotonic() - started < TRICKLE_S / 3


def test_a_slow_name_server_is_cut_off_at_the_attempts_timeout(trickler: int) -> None:
    def slow_name_server(host: str, port: int) -> list[str]:
        time.sleep(3)
        return ["127.0.0.1"]

    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException, match="within 1 s"):
        _post(f"http://hooks.invalid:{trickler}/hook", 1.0, resolver=slow_name_server)
    assert time.monotonic() - started < 2.5  # the timeout, not the name server's 3 s


def test_attempts_share_one_tls_context(trickler: int, monkeypatch) -> None:
    """Each attempt used to make a client with a TLS context of its own, loading every root
    certificate again: under a stream of attempts (a trickling receiver's retries) a control
    worker grew by tens of MiB. The roots are loaded once per process."""
    import ssl

    loads: list[object] = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    for _ in range(4):
        with pytest.raises(httpx.TimeoutException):
            _post(f"http://127.0.0.1:{trickler}/hook", 0.3)
    assert len(loads) <= 1
