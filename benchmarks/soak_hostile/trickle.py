"""The trickling webhook receiver: it reads an event, then answers one byte a second, never
finishing (in quiet phases it answers at once)."""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Trickle:
    t: float  # when the connection was accepted
    held_s: float  # until the sender closed it (or the receiver gave up)
    bytes_sent: int
    ended: str  # "sender closed" | "receiver gave up" | "answered at once" | "stopped"
    batch_id: str | None


class TrickleReceiver:
    """A loopback server for webhooks that reads each request and, while ``trickling()``,
    answers one byte a second without ever finishing the answer (up to ``max_hold_s``);
    otherwise it answers ``200`` at once. Each connection is recorded."""

    def __init__(self, clock: Callable[[], float], trickling: Callable[[], bool],
                 max_hold_s: float = 120.0):  # fmt: skip
        self.clock = clock
        self.trickling = trickling
        self.max_hold_s = max_hold_s
        self.records: list[Trickle] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="soak-trickle", daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook/hostile") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        began = self.clock()
        sent = 0
        ended = "stopped"
        batch_id = None
        try:
            conn.settimeout(10)
            batch_id = _read_event(conn)
            if not self.trickling():
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                ended = "answered at once"
                return
            answer = b"HTTP/1.1 200 OK\r\nx-trickle: " + b"a" * 100_000
            while not self._stop.is_set():
                if self.clock() - began > self.max_hold_s:
                    ended = "receiver gave up"
                    return
                try:
                    conn.sendall(answer[sent : sent + 1])
                except OSError:
                    ended = "sender closed"
                    return
                sent += 1
                readable, _, _ = select.select([conn], [], [], 1.0)
                if readable:
                    try:
                        if not conn.recv(4096):
                            ended = "sender closed"
                            return
                    except OSError:
                        ended = "sender closed"
                        return
        except OSError:
            ended = "sender closed"
        finally:
            conn.close()
            with self.lock:
                self.records.append(Trickle(began, self.clock() - began, sent, ended, batch_id))

    def snapshot(self) -> list[Trickle]:
        with self.lock:
            return list(self.records)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _read_event(conn: socket.socket) -> str | None:
    """Read one HTTP request (headers, then content-length bytes); the event's batch id."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip() or 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    try:
        return str(json.loads(body)["data"]["id"])
    except (ValueError, KeyError, TypeError):
        return None
