"""A loopback TCP proxy that cuts the service off from Postgres or Redis on demand.

The tests and ``benchmarks.soak`` put it between the service's processes and Postgres or Redis
to simulate outages: ``cut()`` closes every proxied connection and refuses new ones (accepted,
then closed at once) until ``resume()``; ``stall()`` is the silent kind (a lost route, a host
gone without closing anything): every connection stays open and nothing reaches the other end,
new ones are accepted and never answered, until ``resume()``, which closes what was held.
Standard library only."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._refusing = False
        self._flowing = threading.Event()  # cleared while stalled
        self._flowing.set()
        self._held: list[socket.socket] = []  # connections accepted while stalled
        self._closed = False
        self.refused = 0  # connections refused while cut
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def url_for(self, url: str, port: int) -> str:
        """``url`` with its ``:port`` replaced by this proxy's."""
        return url.replace(f":{port}", f":{self.port}", 1)

    def cut(self) -> None:
        with self._lock:
            self._refusing = True
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)

    def stall(self) -> None:
        """Forward nothing, close nothing: what is sent is held, and what connects waits."""
        self._flowing.clear()

    def resume(self) -> None:
        with self._lock:
            self._refusing = False
            held, self._held = self._held, []
            stalled = not self._flowing.is_set()
            socks = list(self._socks) if stalled else []
            if stalled:
                self._socks = set()
        # A stall ends as a lost route does: the connections it held are gone.
        for s in held + socks:
            _close(s)
        self._flowing.set()

    def outage(self, seconds: float) -> threading.Thread:
        """Cut now and resume after ``seconds``, in the background."""
        self.cut()

        def later() -> None:
            time.sleep(seconds)
            self.resume()

        t = threading.Thread(target=later, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self._closed = True
        self.resume()
        self.cut()
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
                if not refusing and not self._flowing.is_set():
                    self._held.append(client)
                    continue
            if refusing:
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._refusing:
                    _close(client)
                    _close(upstream)
                    continue
                self._socks.update((client, upstream))
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)
            with self._lock:
                self._socks.discard(src)
                self._socks.discard(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
