"""Raw-socket abuse: slow uploads that trickle a byte every few seconds, and large bodies sent
without a key or past a route's limit, made as they are sent."""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class SlowUpload:
    phase: int
    opened_t: float
    held_s: float = 0.0
    bytes_sent: int = 0
    ended: str = ""  # "server closed" | "server answered: <status line>" | "client gave up" | ...


def slow_upload(
    port: int, key: str, until: Callable[[], bool], every_s: float, record: SlowUpload,
    clock: Callable[[], float],
) -> None:  # fmt: skip
    """``POST /v1/files`` by hand: the headers (a 1 MiB multipart body announced), then one
    byte of the body every ``every_s`` until ``until()`` or the server cuts it off."""
    boundary = "soakslowupload"
    preamble = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        'filename="slow.jsonl"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()
    body = preamble + b"a\n" * (512 * 1024)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    began = clock()
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError as error:
        record.ended = f"could not connect: {type(error).__name__}"
        return
    try:
        conn.sendall(head)
        while True:
            readable, _, _ = select.select([conn], [], [], every_s)
            if readable:
                data = conn.recv(4096)
                record.ended = (
                    "server answered: " + data.split(b"\r\n", 1)[0].decode(errors="replace")
                    if data else "server closed"
                )  # fmt: skip
                return
            if until():
                record.ended = "client gave up"
                return
            conn.sendall(body[record.bytes_sent : record.bytes_sent + 1])
            record.bytes_sent += 1
    except OSError as error:
        record.ended = f"server reset ({type(error).__name__})"
    finally:
        record.held_s = round(clock() - began, 1)
        conn.close()


MIB = 1024 * 1024
_PIECE = 64 * 1024
_PAYLOAD = b"a" * _PIECE  # every piece of every body: nothing held but this


@dataclass(frozen=True, slots=True)
class BodyPlan:
    """One kind of large request: a body of ``HostileOptions.body_mib`` (chunked, or announced
    by a ``Content-Length`` of ``declared_mib``, ``body_mib`` when 0), with or without the
    hostile key; the gate must answer 401 (no key) or 413 (over the route's limit)."""

    route: str
    keyed: bool
    framing: str  # "chunked" | "declared"
    declared_mib: int = 0

    @property
    def name(self) -> str:
        return f"{'key' if self.keyed else 'no key'}, {self.framing}: POST {self.route}"


BODY_PLANS = (
    BodyPlan("/v1/batches", False, "chunked"),
    BodyPlan("/v1/batches", False, "declared"),
    BodyPlan("/v1/messages/batches", False, "chunked"),
    BodyPlan("/v1/messages/batches", False, "declared", declared_mib=1024 * 1024),  # 1 TiB
    BodyPlan("/v1/batches", True, "chunked"),
    BodyPlan("/v1/batches", True, "declared"),
)


@dataclass
class BodyAttempt:
    plan: str  # BodyPlan.name
    keyed: bool
    began: float  # on the soak's clock
    limit: int  # body bytes the server may read before it must answer (0: it must not read)
    status: int | None = None  # the answer's, when one was read
    ended: str = ""  # "answered" | "closed" | "reset" | "could not connect" | "timed out"
    bytes_sent: int = 0  # body bytes (chunk framing included) written before the answer
    answer_s: float | None = None  # from the start to the answer, or to the close
    limit_s: float | None = None  # from the start to when the bytes sent passed ``limit``


def _status_of(head: bytes) -> int | None:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def send_large_body(
    port: int, plan: BodyPlan, key: str | None, total: int, record: BodyAttempt,
    clock: Callable[[], float], timeout_s: float = 30.0,
) -> None:  # fmt: skip
    """``POST plan.route`` by hand: the headers, then up to ``total`` bytes of body (64 KiB
    pieces made of one buffer), reading between pieces; it stops as soon as the server
    answers or closes, and records the status (if any was read), the bytes sent and when."""
    declared = plan.declared_mib * MIB or total
    head = (
        f"POST {plan.route} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
        + (f"Authorization: Bearer {key}\r\n" if plan.keyed and key else "")
        + ("Transfer-Encoding: chunked\r\n" if plan.framing == "chunked"
           else f"Content-Length: {declared}\r\n")
        + "\r\n"
    ).encode()  # fmt: skip
    piece = b"%x\r\n%s\r\n" % (_PIECE, _PAYLOAD) if plan.framing == "chunked" else _PAYLOAD
    began = clock()
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as error:
        record.ended = f"could not connect ({type(error).__name__})"
        return
    got = b""
    pending = memoryview(head)
    head_left = len(head)
    payload = 0  # payload bytes queued so far
    finished = False  # the whole body (and the last chunk) queued

    def answered(data: bytes) -> None:
        record.status = _status_of(data)

    try:
        conn.setblocking(False)
        while True:
            if clock() - began > timeout_s:
                record.ended = "timed out"
                return
            writing = [conn] if pending or not finished else []
            readable, writable, _ = select.select([conn], writing, [], 0.5)
            if readable:
                try:
                    data = conn.recv(65536)
                except BlockingIOError:
                    data = None
                except OSError:
                    record.ended = "reset"
                    answered(got)
                    return
                if data is not None:
                    if not data:
                        record.ended = "closed"
                        answered(got)
                        return
                    got += data
                    if b"\r\n" in got:
                        record.ended = "answered"
                        answered(got)
                        return
                    continue
            if not writable:
                continue
            if not pending:
                if payload >= total:
                    pending = memoryview(b"0\r\n\r\n" if plan.framing == "chunked" else b"")
                    finished = True
                    if not pending:
                        continue
                else:
                    pending = memoryview(piece)
                    payload += _PIECE
            try:
                sent = conn.send(pending)
            except BlockingIOError:
                continue
            except OSError:  # the server closed or reset: its answer may be waiting
                with contextlib.suppress(OSError):
                    conn.setblocking(True)
                    conn.settimeout(1.0)
                    got += conn.recv(65536)
                record.ended = "answered" if _status_of(got) else "reset"
                answered(got)
                return
            if head_left:  # the head goes out alone, before any piece of the body
                head_left -= sent
            else:
                record.bytes_sent += sent
            pending = pending[sent:]
            if record.limit_s is None and record.bytes_sent > record.limit:
                record.limit_s = clock() - began
    finally:
        record.answer_s = clock() - began
        conn.close()
