"""The hostile tenant of ``benchmarks.soak --hostile``: abuse beside the normal tenants.

The hostile tenant of ``benchmarks.soak --hostile``: one more tenant, with its own key, that
abuses the service in alternate phases of the run (:class:`Phases`: by default the 2nd and 4th
quarter) while the normal tenants go on as usual, so that their batches' turnaround can be
compared between phases of one run (``soak_checks.neighbour_invariant``). While active it
loops over:

* nested lines: a file with request lines nested ``nested_depth`` levels deep (arrays,
  objects, a request whose body is nested) among good lines, in the head or after it; the
  batch is created and cancelled at once;
* amplification: ``amplify_mib`` of ``a`` lines (each one a line the service must answer for)
  after a head of good lines, created and cancelled at once: the cancel reports the lines never
  validated, at most ``max_requests_per_batch`` of them and then one line naming the limit;
* a small batch that runs; every one of its batches has its webhook go to
  :class:`TrickleReceiver`, a loopback server that reads the event and then answers one byte a
  second, never finishing (in quiet phases it answers 200 at once, so the deliveries the
  hostile phase left retrying end);
* slow uploads: ``slow_uploads`` raw-socket ``POST /v1/files`` that send the headers and then
  one byte every ``trickle_every_s``, for the whole phase unless the server cuts them first;
* estimate floods: ``estimates`` concurrent ``POST /v1/batches/estimate`` on a file of
  ``estimate_lines`` lines every ``estimate_every_s``, half of them from clients that give up
  after half a second;
* large bodies: ``body_senders`` raw-socket senders, each every ``body_every_s`` one of
  :data:`BODY_PLANS` in turn: ``body_mib`` of body made as it is sent (chunked, or announced by
  a ``Content-Length``), without a key to ``POST /v1/batches`` and ``POST
  /v1/messages/batches`` (401 before a byte of it is read) and with the hostile key to ``POST
  /v1/batches`` (413: at once on the ``Content-Length``, at the route's limit when chunked).
  A sender reads between pieces and stops at the answer or the close; each attempt's status,
  the bytes it got sent and when the answer came are recorded (:class:`BodyAttempt`), and
  :class:`ApiMemory` samples the API's RSS and high-water mark every second meanwhile;
* upload bounds: every ``upload_every_s``, an upload of 1,024 bytes and one of 1 byte, each
  sent parts past its declared bytes, then completed or cancelled and sent a part (and a
  cancel or complete) after; once a phase, one past the parts bound (``upload_parts``, the
  ``max_upload_parts`` the soak sets). Each step's answer is recorded against
  :data:`UPLOAD_EXPECT`.

Its batches are tracked apart (:class:`HostileTracker`): they are designed to fail or to be
cancelled, so the normal invariants do not apply, but each must end, and a cancelled one's
output and error files together hold at most ``min(lines, max_requests_per_batch) + 1``
lines. Its API answers are logged apart too: a 500 among them is a failure, the rest is
reported. The large bodies, the upload steps and the API's memory are judged by
:func:`large_body_invariant`, :func:`upload_abuse_invariant` and
:func:`api_memory_invariant`."""

from __future__ import annotations

import contextlib
import functools
import json
import select
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from cli.perf.service import memory_kb
from cli.perf.workload import request_line
from tests.harness.soak_checks import TERMINAL, Api, BatchRecord, HttpLog, Tracker, Window
from tests.harness.soak_stack import CHAT_MODEL

HOSTILE = "hostile"
CHAT = "/v1/chat/completions"


# ---------------------------------------------------------------------------------------------
# Phases


@dataclass(frozen=True, slots=True)
class Phase:
    index: int
    start: float
    end: float
    hostile: bool


class Phases:
    """The run's traffic span ``[t0, t0 + duration)`` cut into ``count`` equal phases; the
    hostile tenant is active in every other one, from the second (quiet, hostile, quiet, ...)."""

    def __init__(self, t0: float, duration: float, count: int):
        count = max(2, count)
        span = duration / count
        self.phases = [
            Phase(i, t0 + i * span, t0 + (i + 1) * span, i % 2 == 1) for i in range(count)
        ]

    def at(self, t: float) -> Phase | None:
        for p in self.phases:
            if p.start <= t < p.end:
                return p
        return None

    def hostile_at(self, t: float) -> bool:
        p = self.at(t)
        return p is not None and p.hostile

    def windows(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.phases]


# ---------------------------------------------------------------------------------------------
# Files


def _good(cid: str) -> dict[str, Any]:
    return request_line(
        cid,
        {
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": f"say {cid}"}],
            "max_tokens": 6,
            "temperature": 0,
        },
    )


def nested_lines(depth: int) -> list[str]:
    """Lines nested ``depth`` levels deep: an array, an object, and a request line whose body
    (and one whose message content) is nested; none can be read as a request."""
    array = "[" * depth + "]" * depth
    obj = '{"a":' * depth + "1" + "}" * depth
    return [
        array,
        obj,
        json.dumps({"custom_id": "deep-body", "method": "POST", "url": CHAT})[:-1]
        + f', "body": {obj}}}',
        json.dumps({"custom_id": "deep-content", "method": "POST", "url": CHAT})[:-1]
        + f', "body": {{"model": "{CHAT_MODEL}", "messages": {array}}}}}',
    ]


def nested_file(seq: int, depth: int, head: int) -> tuple[bytes, int]:
    """Good lines around nested ones; the nested ones in the head on odd ``seq``, after it
    (past ``head`` good lines) on even. The bytes and the number of lines."""
    good = [json.dumps(_good(f"h{seq}-{i:03d}")) for i in range(head + 4)]
    bad = nested_lines(depth) * 3
    lines = [good[0], *bad, *good[1:]] if seq % 2 else [*good[: head + 1], *bad, *good[head + 1 :]]
    return "".join(x + "\n" for x in lines).encode(), len(lines)


def amplifying_file(seq: int, mib: float, head: int) -> tuple[bytes, int]:
    """``head`` good lines, then ``mib`` MiB of ``a`` lines: a small upload with a million
    lines to answer for. The bytes and the number of lines."""
    good = "".join(json.dumps(_good(f"a{seq}-{i:03d}")) + "\n" for i in range(head)).encode()
    tiny = int(mib * 1024 * 1024) // 2
    return good + b"a\n" * tiny, head + tiny


def estimate_file(lines: int) -> bytes:
    return "".join(json.dumps(_good(f"e-{i:06d}")) + "\n" for i in range(lines)).encode()


# ---------------------------------------------------------------------------------------------
# The trickling webhook receiver


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


# ---------------------------------------------------------------------------------------------
# Slow uploads


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


# ---------------------------------------------------------------------------------------------
# Large bodies: without a key, or over the route's limit

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


# ---------------------------------------------------------------------------------------------
# Uploads past their bounds

#: What each step of the upload abuser must be answered.
UPLOAD_EXPECT = {
    "create": 200,
    "part within bytes": 200,
    "part past bytes": 400,
    "part past the parts bound": 400,
    "complete": 200,
    "part after complete": 400,
    "cancel after complete": 400,
    "cancel": 200,
    "part after cancel": 400,
    "complete after cancel": 400,
}


@dataclass(frozen=True, slots=True)
class UploadAnswer:
    began: float
    t: float
    kind: str  # a key of UPLOAD_EXPECT
    status: int | None  # None: no answer (connection refused or reset, timeout)
    code: str | None = None  # the error's code, for a 4xx


def _error_code(r: httpx.Response | None) -> str | None:
    if r is None or r.status_code < 400:
        return None
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return None if code is None else str(code)


# ---------------------------------------------------------------------------------------------
# The API's memory


@dataclass(frozen=True, slots=True)
class MemorySample:
    t: float
    pid: int
    rss_kib: int
    hwm_kib: int  # VmHWM: the most the process held at any time before this sample
    active: bool  # the large-body senders at work


class ApiMemory:
    """The API process's RSS and high-water mark every time :meth:`sample` is called (the
    stack's own sampler reads every process's RSS every few seconds; the high-water mark
    catches a peak between two samples), each marked with whether the large-body senders
    were at work."""

    def __init__(self, pid: Callable[[], int | None], clock: Callable[[], float],
                 active: Callable[[], bool]):  # fmt: skip
        self.pid = pid
        self.clock = clock
        self.active = active
        self.samples: list[MemorySample] = []
        self.lock = threading.Lock()

    def sample(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        active = self.active()
        got = memory_kb(pid)
        if got is None:
            return
        with self.lock:
            self.samples.append(MemorySample(self.clock(), pid, got[0], got[1], active))

    def snapshot(self) -> list[MemorySample]:
        with self.lock:
            return list(self.samples)


class PgSampler:
    """Postgres's view of the service's connections (``pg_stat_activity`` on the soak's
    database, read straight, not through the cut-able proxy): how many are idle inside a
    transaction, sampled with the number of slow uploads open at the time."""

    def __init__(self, url: str, clock: Callable[[], float], slow_open: Callable[[], int]):
        from sqlalchemy import create_engine

        self.engine = create_engine(url, pool_size=1, max_overflow=0)
        self.clock = clock
        self.slow_open = slow_open
        self.samples: list[tuple[float, int, int, int]] = []  # t, idle in tx, all, slow open

    def sample(self) -> None:
        from sqlalchemy import text

        try:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT state, count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "GROUP BY state"
                    )
                ).all()
        except Exception:  # the database restarting: no sample
            return
        states = {str(state): int(n) for state, n in rows}
        self.samples.append(
            (self.clock(), states.get("idle in transaction", 0), sum(states.values()),
             self.slow_open())
        )  # fmt: skip

    def report(self) -> dict[str, Any]:
        def summary(rows: list[tuple[float, int, int, int]]) -> dict[str, Any] | None:
            if not rows:
                return None
            idle = [r[1] for r in rows]
            return {"samples": len(rows), "idle_in_transaction_median": statistics.median(idle),
                    "idle_in_transaction_max": max(idle),
                    "connections_max": max(r[2] for r in rows)}  # fmt: skip

        return {
            "with_slow_uploads_open": summary([r for r in self.samples if r[3] > 0]),
            "without": summary([r for r in self.samples if r[3] == 0]),
            "slow_uploads_open_max": max((r[3] for r in self.samples), default=0),
        }

    def close(self) -> None:
        self.engine.dispose()


# ---------------------------------------------------------------------------------------------
# Its batches


class HostileTracker(Tracker):
    """The hostile tenant's batches: polled like the others, but when one ends only the size
    of its files is checked: output and error lines together at most ``min(lines in its
    file, max_requests_per_batch) + 1``."""

    def __init__(self, api: Api, clock: Callable[[], float], poll_s: float, max_requests: int):
        super().__init__(api, clock, poll_s, expiry_grace_s=0.0)
        self.max_requests = max_requests
        self.file_lines: dict[str, int] = {}
        self.file_results: dict[str, dict[str, int]] = {}
        self.bound_violations: list[dict[str, Any]] = []

    def add_batch(self, record: BatchRecord, file_lines: int) -> None:
        self.file_lines[record.id] = file_lines
        self.add(record)

    def bound(self, batch_id: str) -> int:
        return min(self.file_lines.get(batch_id, self.max_requests), self.max_requests) + 1

    def _count(self, record: BatchRecord, file_id: str | None) -> tuple[int, Counter] | None:
        if file_id is None:
            return 0, Counter()
        r = self.api.call(
            record.tenant, "GET", f"/v1/files/{file_id}/content", "GET /v1/files/{id}/content"
        )
        if r is None or r.status_code != 200:
            return None
        codes: Counter = Counter()
        lines = 0
        for raw in r.text.splitlines():
            if not raw.strip():
                continue
            lines += 1
            try:
                line = json.loads(raw)
                error = line.get("error") or {}
                code = error.get("code") if isinstance(error, dict) else None
                codes[str(code) if code else "output"] += 1
            except ValueError:
                codes["unreadable"] += 1
        return lines, codes

    def _check_lines(self, record: BatchRecord) -> None:
        record.check_attempts += 1
        out = self._count(record, record.output_file_id)
        err = self._count(record, record.error_file_id)
        if out is None or err is None:
            return
        record.checked = True
        record.outputs = out[0]
        record.error_codes = err[1]
        total = out[0] + err[0]
        self.file_results[record.id] = {"output_lines": out[0], "error_lines": err[0]}
        if total > self.bound(record.id):
            self.bound_violations.append(
                {"batch": record.id, "kind": record.kind, "status": record.status,
                 "file_lines": self.file_lines.get(record.id), "output_lines": out[0],
                 "error_lines": err[0], "bound": self.bound(record.id)}
            )  # fmt: skip

    def _check_overdue(self) -> None:
        pass  # 24 h windows: nothing to expire


# ---------------------------------------------------------------------------------------------
# The tenant


@dataclass
class HostileOptions:
    every_s: float = 10.0  # between two of its batches (nested, amplifying, small in turn)
    nested_depth: int = 2000
    amplify_mib: float = 2.0
    slow_uploads: int = 4
    trickle_every_s: float = 3.0
    estimates: int = 16
    estimate_every_s: float = 20.0
    estimate_lines: int = 10_000
    give_up_after_s: float = 0.5  # the estimate clients that disconnect early
    body_senders: int = 4  # concurrent large-body senders (BODY_PLANS in turn)
    body_mib: int = 256  # each large body, made as it is sent
    body_every_s: float = 1.0  # between one sender's requests
    body_timeout_s: float = 30.0  # a large body unanswered this long: given up (a failure)
    answer_within_s: float = 2.0  # a refusal's most seconds after it was due
    api_rss_bound_mib: float = 256.0  # the API's peak over its RSS before the senders began
    upload_every_s: float = 5.0  # between two rounds of the upload abuser
    upload_parts: int = 50  # max_upload_parts of the soak's service: the parts bound abused
    upload_busy_s: float = 40.0  # how long a step is sent again while it gets 429


@dataclass
class HostileStats:
    batches: Counter = field(default_factory=Counter)  # by kind
    upload_failed: Counter = field(default_factory=Counter)  # by kind
    create_answers: Counter = field(default_factory=Counter)  # "kind status"
    cancel_answers: Counter = field(default_factory=Counter)
    estimate_answers: Counter = field(default_factory=Counter)  # "patient 200", "hasty gave up"
    estimate_latency_s: list[float] = field(default_factory=list)  # patient clients' answers
    floods: int = 0
    slow_uploads: list[SlowUpload] = field(default_factory=list)
    bodies: list[BodyAttempt] = field(default_factory=list)
    upload_answers: list[UploadAnswer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class HostileTenant:
    """The threads of the hostile tenant (see the module docstring); each acts only while
    ``phases`` says the hostile tenant is active, and all stop at ``end_t``."""

    def __init__(self, opts: HostileOptions, api: Api, key: str, port: int,
                 tracker: HostileTracker, trickle: TrickleReceiver, phases: Phases,
                 clock: Callable[[], float], end_t: float, head: int,
                 body_limit: int = MIB):  # fmt: skip
        self.opts = opts
        self.api = api
        self.key = key
        self.port = port
        self.tracker = tracker
        self.trickle = trickle
        self.phases = phases
        self.clock = clock
        self.end_t = end_t
        self.head = head
        self.body_limit = body_limit  # max_request_body_bytes: the JSON routes' limit
        self.stats = HostileStats()
        self.stop = threading.Event()
        self._estimate_file: str | None = None
        self._upload_id: str | None = None  # the upload abuser's current upload
        self.threads = [
            threading.Thread(target=self._guard(self._batches), name="soak-hostile", daemon=True),
            threading.Thread(target=self._guard(self._floods), name="soak-flood", daemon=True),
            threading.Thread(target=self._guard(self._slow), name="soak-slow", daemon=True),
            threading.Thread(target=self._guard(self._uploads), name="soak-parts", daemon=True),
            *(
                threading.Thread(target=self._guard(functools.partial(self._bodies, i)),
                                 name=f"soak-body-{i}", daemon=True)
                for i in range(self.opts.body_senders)
            ),
        ]  # fmt: skip

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        self.join(30)

    def _guard(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except Exception as error:  # a harness bug: say so
                print(f"soak hostile: {type(error).__name__}: {error}", flush=True)
                with self.stats.lock:
                    self.stats.errors.append(f"{type(error).__name__}: {error}")

        return run

    def _wait_active(self) -> bool:
        """Sleep until the tenant is active (True) or the traffic is over (False)."""
        while not self.stop.is_set() and self.clock() < self.end_t:
            if self.phases.hostile_at(self.clock()):
                return True
            self.stop.wait(0.5)
        return False

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(max(0.0, min(seconds, self.end_t - self.clock())))

    # -- batches: nested, amplifying, small; all with the trickled webhook -------------------

    def _batches(self) -> None:
        kinds = ("nested", "amplify", "small")
        seq = 0
        while self._wait_active():
            seq += 1
            kind = kinds[(seq - 1) % len(kinds)]
            began = self.clock()
            if kind == "nested":
                data, n = nested_file(seq, self.opts.nested_depth, self.head)
            elif kind == "amplify":
                data, n = amplifying_file(seq, self.opts.amplify_mib, self.head)
            else:
                data = "".join(json.dumps(_good(f"w{seq}-{i}")) + "\n" for i in range(3)).encode()
                n = 3
            self._submit(kind, seq, data, n, cancel=kind != "small")
            self._sleep(self.opts.every_s - (self.clock() - began))

    def _submit(self, kind: str, seq: int, data: bytes, lines: int, cancel: bool) -> None:
        up = self.api.retrying(
            HOSTILE, "POST", "/v1/files", "POST /v1/files", for_s=30,
            make_kw=lambda: {"data": {"purpose": "batch"},
                             "files": {"file": (f"hostile-{kind}-{seq}.jsonl", data)}},
        )  # fmt: skip
        if up is None or up.status_code != 200:
            with self.stats.lock:
                self.stats.upload_failed[kind] += 1
            return
        body: dict[str, Any] = {
            "input_file_id": up.json()["id"],
            "endpoint": CHAT,
            "completion_window": "24h",
            "metadata": {"soak": f"hostile-{kind}"},
        }
        body["webhook_url"] = self.trickle.url()  # its events come while it is active
        created = self.api.retrying(
            HOSTILE, "POST", "/v1/batches", "POST /v1/batches", for_s=30, json=body,
            headers={"Idempotency-Key": f"soak-hostile-{seq}"},
        )  # fmt: skip
        with self.stats.lock:
            self.stats.create_answers[
                f"{kind} {created.status_code if created is not None else 'no answer'}"
            ] += 1
        if created is None or created.status_code != 200:
            return
        batch = created.json()
        record = BatchRecord(
            id=batch["id"], tenant=HOSTILE, kind=kind, endpoint=CHAT, custom_ids=[],
            window="24h", priority_requested="normal", priority=batch.get("priority", "normal"),
            webhook=True, created_t=self.clock(), expires_at=None,
            status=batch["status"], seen_wall=time.time(),
        )  # fmt: skip
        self.tracker.add_batch(record, lines)
        with self.stats.lock:
            self.stats.batches[kind] += 1
        if cancel:
            r = self.api.retrying(
                HOSTILE, "POST", f"/v1/batches/{record.id}/cancel",
                "POST /v1/batches/{id}/cancel", for_s=60,
            )  # fmt: skip
            record.cancel_requested_t = self.clock()
            with self.stats.lock:
                self.stats.cancel_answers[str(r.status_code if r is not None else "no answer")] += 1

    # -- estimate floods ----------------------------------------------------------------------

    def _floods(self) -> None:
        while self._wait_active():
            began = self.clock()
            if self._estimate_file is None:
                data = estimate_file(self.opts.estimate_lines)
                up = self.api.retrying(
                    HOSTILE, "POST", "/v1/files", "POST /v1/files", for_s=30,
                    make_kw=lambda data=data: {
                        "data": {"purpose": "batch"},
                        "files": {"file": ("hostile-estimate.jsonl", data)}},
                )  # fmt: skip
                if up is None or up.status_code != 200:
                    with self.stats.lock:
                        self.stats.upload_failed["estimate"] += 1
                    self._sleep(self.opts.estimate_every_s)
                    continue
                self._estimate_file = up.json()["id"]
            body = {
                "input_file_id": self._estimate_file,
                "endpoint": CHAT,
                "completion_window": "24h",
            }
            clients = [
                threading.Thread(target=self._estimate, args=(body, i % 2 == 0), daemon=True)
                for i in range(self.opts.estimates)
            ]
            for c in clients:
                c.start()
            for c in clients:
                c.join(120)
            with self.stats.lock:
                self.stats.floods += 1
            self._sleep(self.opts.estimate_every_s - (self.clock() - began))

    def _estimate(self, body: dict[str, Any], hasty: bool) -> None:
        who = "hasty" if hasty else "patient"
        timeout = self.opts.give_up_after_s if hasty else 90.0
        began = self.clock()
        r = self.api.call(
            HOSTILE, "POST", "/v1/batches/estimate", "POST /v1/batches/estimate",
            json=body, timeout=timeout,
        )  # fmt: skip
        with self.stats.lock:
            if r is None:
                self.stats.estimate_answers[f"{who} gave up" if hasty else f"{who} no answer"] += 1
            else:
                self.stats.estimate_answers[f"{who} {r.status_code}"] += 1
                if not hasty and r.status_code == 200:
                    self.stats.estimate_latency_s.append(self.clock() - began)

    # -- slow uploads -------------------------------------------------------------------------

    def _slow(self) -> None:
        while self._wait_active():
            phase = self.phases.at(self.clock())
            assert phase is not None
            opened = []
            for _ in range(self.opts.slow_uploads):
                record = SlowUpload(phase.index, round(self.clock(), 1))
                with self.stats.lock:
                    self.stats.slow_uploads.append(record)
                t = threading.Thread(
                    target=slow_upload,
                    args=(self.port, self.key, lambda p=phase: self._phase_over(p),
                          self.opts.trickle_every_s, record, self.clock),
                    daemon=True,
                )  # fmt: skip
                t.start()
                opened.append(t)
            for t in opened:
                t.join(phase.end - phase.start + 60)
            # Not again in this phase (if the server cut them all short): wait for the next.
            while not self.stop.is_set() and self.clock() < min(phase.end, self.end_t):
                self.stop.wait(0.5)

    def slow_open(self) -> int:
        with self.stats.lock:
            return sum(1 for u in self.stats.slow_uploads if not u.ended)

    def _phase_over(self, phase: Phase) -> bool:
        return self.stop.is_set() or self.clock() >= min(phase.end, self.end_t)

    # -- large bodies -------------------------------------------------------------------------

    def _bodies(self, index: int) -> None:
        seq = index
        while self._wait_active():
            plan = BODY_PLANS[seq % len(BODY_PLANS)]
            seq += 1
            began = self.clock()
            limit = self.body_limit if plan.keyed and plan.framing == "chunked" else 0
            record = BodyAttempt(plan.name, plan.keyed, round(began, 2), limit)
            with self.stats.lock:
                self.stats.bodies.append(record)
            send_large_body(self.port, plan, self.key, self.opts.body_mib * MIB, record,
                            self.clock, self.opts.body_timeout_s)  # fmt: skip
            self._sleep(self.opts.body_every_s - (self.clock() - began))

    def bodies_open(self) -> int:
        with self.stats.lock:
            return sum(1 for b in self.stats.bodies if not b.ended)

    # -- uploads past their bounds ------------------------------------------------------------

    def _uploads(self) -> None:
        bounded_in = -1  # the phase whose parts bound was last abused (once a phase)
        while self._wait_active():
            began = self.clock()
            phase = self.phases.at(began)
            for round_ in (self._upload_past_bytes, self._upload_of_one_byte):
                self._upload_round(round_)
            if phase is not None and phase.index != bounded_in:
                bounded_in = phase.index
                self._upload_round(self._upload_past_parts)
            self._sleep(self.opts.upload_every_s - (self.clock() - began))

    def _upload_round(self, round_: Callable[[], None]) -> None:
        """One round; one whose step got no answer, a 5xx or a surprise stops there, and its
        upload is cancelled (unjudged: it may have completed)."""
        self._upload_id = None
        try:
            round_()
        except _Stop:
            if self._upload_id is not None:
                self.api.call(HOSTILE, "POST", f"/v1/uploads/{self._upload_id}/cancel",
                              "POST /v1/uploads/{id}/cancel")  # fmt: skip

    def _step(self, kind: str, method: str, path: str, route: str, **kw: Any) -> httpx.Response:
        """One step, sent again after a 429 (the tenant's upload slots are its slow uploads'
        until the server cuts them) for up to ``upload_busy_s``."""
        deadline = self.clock() + self.opts.upload_busy_s
        while True:
            began = self.clock()
            r = self.api.call(HOSTILE, method, path, route, **kw)
            status = None if r is None else r.status_code
            with self.stats.lock:
                self.stats.upload_answers.append(
                    UploadAnswer(round(began, 2), round(self.clock(), 2), kind, status,
                                 _error_code(r))
                )  # fmt: skip
            if status != 429 or self.clock() >= deadline or self.stop.is_set():
                break
            self.stop.wait(1.0)
        if r is None or status != UPLOAD_EXPECT[kind]:
            raise _Stop
        return r

    def _create_upload(self, size: int) -> str:
        body = {"filename": "hostile.jsonl", "purpose": "batch", "bytes": size,
                "mime_type": "application/jsonl"}  # fmt: skip
        r = self._step("create", "POST", "/v1/uploads", "POST /v1/uploads", json=body)
        self._upload_id = str(r.json()["id"])
        return self._upload_id

    def _part(self, kind: str, upload: str, size: int) -> str | None:
        data = ("part", b"a" * size, "application/octet-stream")
        r = self._step(kind, "POST", f"/v1/uploads/{upload}/parts",
                       "POST /v1/uploads/{id}/parts", files={"data": data})  # fmt: skip
        return str(r.json()["id"]) if r.status_code == 200 else None

    def _complete(self, kind: str, upload: str, parts: list[str]) -> None:
        self._step(kind, "POST", f"/v1/uploads/{upload}/complete",
                   "POST /v1/uploads/{id}/complete", json={"part_ids": parts})  # fmt: skip

    def _cancel(self, kind: str, upload: str) -> None:
        self._step(kind, "POST", f"/v1/uploads/{upload}/cancel", "POST /v1/uploads/{id}/cancel")

    def _upload_past_bytes(self) -> None:
        """1,024 bytes declared: parts past them refused, the rest completed; then a part
        and a cancel after the complete, both refused."""
        upload = self._create_upload(1024)
        first = self._part("part within bytes", upload, 1000)
        self._part("part past bytes", upload, 100)
        second = self._part("part within bytes", upload, 24)
        self._part("part past bytes", upload, 1)
        assert first is not None and second is not None
        self._complete("complete", upload, [first, second])
        self._part("part after complete", upload, 1)
        self._cancel("cancel after complete", upload)

    def _upload_of_one_byte(self) -> None:
        """1 byte declared: a 64 KiB part refused as it streams, one byte taken, the next
        refused; cancelled, then a part and a complete refused."""
        upload = self._create_upload(1)
        self._part("part past bytes", upload, 64 * 1024)
        part = self._part("part within bytes", upload, 1)
        self._part("part past bytes", upload, 1)
        self._cancel("cancel", upload)
        self._part("part after cancel", upload, 1)
        assert part is not None
        self._complete("complete after cancel", upload, [part])

    def _upload_past_parts(self) -> None:
        """As many one-byte parts as the service's parts bound, then one more (refused)."""
        upload = self._create_upload(self.opts.upload_parts + 8)
        for _ in range(self.opts.upload_parts):
            if self.stop.is_set():
                raise _Stop
            self._part("part within bytes", upload, 1)
        self._part("part past the parts bound", upload, 1)
        self._cancel("cancel", upload)
        self._upload_id = None

    # -- the report ---------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        with self.stats.lock:
            s = self.stats
            latency = sorted(s.estimate_latency_s)
            return {
                "batches": dict(s.batches),
                "upload_failed": dict(s.upload_failed),
                "create_answers": dict(s.create_answers),
                "cancel_answers": dict(s.cancel_answers),
                "estimate_floods": s.floods,
                "estimate_answers": dict(s.estimate_answers),
                "estimate_latency_s": (
                    {"p50": round(statistics.median(latency), 2), "max": round(latency[-1], 2)}
                    if latency
                    else None
                ),  # fmt: skip
                "slow_uploads": [asdict(u) for u in s.slow_uploads],
                "errors": list(s.errors),
            }


class _Stop(Exception):
    """An upload round stops: a step got no answer, a 5xx, or not what it must."""


def hostile_invariant(
    tracker: HostileTracker, http: HttpLog, trickles: list[Trickle], webhook_timeout_s: float,
    slack_s: float = 5.0,
) -> dict[str, Any]:  # fmt: skip
    """Every hostile batch ended (by the end of the drain) and its files stayed within their
    bound; none of its API answers was a 5xx but 503; no trickled webhook attempt was held
    open by the service much past ``webhook_timeout_s``."""
    records = tracker.records()
    unended = [
        {"batch": r.id, "kind": r.kind, "status": r.status, "request_counts": r.counts}
        for r in records if r.status not in TERMINAL
    ]  # fmt: skip
    answers = http.snapshot()
    by_status = Counter(str(a.status) if a.status is not None else "no answer" for a in answers)
    errors = [
        {"t": round(a.t, 1), "route": a.route, "status": a.status, "detail": a.detail}
        for a in answers if a.status is not None and a.status >= 500 and a.status != 503
    ]  # fmt: skip
    trickled = [t for t in trickles if t.ended != "answered at once"]
    held_long = [
        asdict(t) for t in trickled
        if t.ended == "receiver gave up" or t.held_s > webhook_timeout_s + slack_s
    ]  # fmt: skip
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r.kind, Counter())[r.status] += 1
    violations: list[dict[str, Any]] = []
    violations += [{"unended": u, "batch": u["batch"]} for u in unended]
    violations += [{"bound": v, "batch": v["batch"]} for v in tracker.bound_violations]
    violations += [{"http": e} for e in errors]
    violations += [{"webhook_held_open": h} for h in held_long]
    held = sorted(t.held_s for t in trickled)
    largest = max(
        ({"batch": b, **c, "bound": tracker.bound(b)} for b, c in tracker.file_results.items()),
        key=lambda x: x["output_lines"] + x["error_lines"],
        default=None,
    )
    return {
        "ok": not violations,
        "batches": len(records),
        "by_kind_status": {k: dict(v) for k, v in by_kind.items()},
        "unended": len(unended),
        "largest_result": largest,
        "answers_by_status": dict(sorted(by_status.items())),
        "webhook_attempts_trickled": len(trickled),
        "webhook_attempts_answered_at_once": len(trickles) - len(trickled),
        "webhook_held_s": (
            {"p50": round(statistics.median(held), 1), "max": round(held[-1], 1)} if held else None
        ),  # fmt: skip
        "webhook_timeout_s": webhook_timeout_s,
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def _during(began: float, t: float, outages: list[Window], grace_s: float) -> bool:
    return any(t >= w.start and began <= w.end + grace_s for w in outages)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)
    return {"p50": round(statistics.median(values), 3),
            "p90": round(values[min(len(values) - 1, int(0.9 * len(values)))], 3),
            "max": round(values[-1], 3)}  # fmt: skip


def large_body_invariant(
    attempts: list[BodyAttempt], outages: list[Window], grace_s: float, within_s: float = 2.0,
    slack_bytes: int = 64 * MIB,
) -> dict[str, Any]:  # fmt: skip
    """Every large body refused: answered 401 or 413, or its connection closed by the server
    (a keyed one may get 503 while the database or broker is cut off, ``outages`` plus
    ``grace_s``: its key cannot be looked up), never unanswered; the refusal within
    ``within_s`` of when it was due (the request's start, unless the body is counted as it
    streams: then when the client had sent more than the route's limit); and the client never
    got more than ``slack_bytes`` (what the sockets' buffers hold) past that limit sent, so
    the server stopped reading. Attempts that could not connect (the API restarting) are
    counted, not judged."""
    violations: list[dict[str, Any]] = []
    by_plan: dict[str, Counter] = {}
    due_at_start: list[float] = []
    due_at_limit: list[float] = []
    sent_max: dict[str, int] = {}
    unconnected = 0
    for a in attempts:
        if not a.ended:  # still in flight when the run stopped
            continue
        outcome = str(a.status) if a.status is not None else a.ended.split(" (")[0]
        by_plan.setdefault(a.plan, Counter())[outcome] += 1
        if a.ended.startswith("could not connect"):
            unconnected += 1
            continue
        sent_max[a.plan] = max(sent_max.get(a.plan, 0), a.bytes_sent)
        waited = a.answer_s or 0.0
        if a.limit:  # counted as it streams: due once the client had sent past the limit
            waited = max(0.0, waited - a.limit_s) if a.limit_s is not None else 0.0
        excused = (
            a.status == 503 and a.keyed and _during(a.began, a.began + waited, outages, grace_s)
        )
        problem: dict[str, Any] = {}
        if a.ended == "timed out":
            problem["unanswered_after_s"] = round(a.answer_s or 0.0, 1)
        elif a.status is not None and a.status not in (401, 413) and not excused:
            problem["wrong_status"] = a.status
        if not excused and "unanswered_after_s" not in problem:
            (due_at_limit if a.limit else due_at_start).append(waited)
            if waited > within_s:
                problem["answered_after_s"] = round(waited, 2)
        if a.bytes_sent > a.limit + slack_bytes:
            problem["bytes_sent"] = a.bytes_sent
        if problem:
            violations.append({"t": a.began, "plan": a.plan, "ended": a.ended,
                               "status": a.status, **problem})  # fmt: skip
    return {
        "ok": not violations,
        "attempts": sum(sum(c.values()) for c in by_plan.values()),
        "by_outcome": dict(sum(by_plan.values(), Counter()).most_common()),
        "by_plan": {plan: dict(c) for plan, c in sorted(by_plan.items())},
        "could_not_connect": unconnected,
        "answer_s": _spread(due_at_start),  # 401s and 413s on a Content-Length
        "after_limit_s": _spread(due_at_limit),  # 413s counted as the body streamed
        "within_s": within_s,
        "bytes_sent_max_mib": {p: round(b / MIB, 2) for p, b in sorted(sent_max.items())},
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def upload_abuse_invariant(
    answers: list[UploadAnswer], outages: list[Window], grace_s: float
) -> dict[str, Any]:
    """Every step of the upload abuser answered as :data:`UPLOAD_EXPECT` says: 400 for a part
    past the declared bytes or the parts bound, or after a complete or cancel, for a cancel
    after a complete, a complete after a cancel; 200 for the steps in between. A 429 (the
    tenant's concurrent uploads, its slow ones among them) refuses without taking anything
    and is counted as busy; a 503 is excused during ``outages`` (plus ``grace_s``); a step
    with no answer is counted."""
    by_kind: dict[str, Counter] = {}
    violations: list[dict[str, Any]] = []
    unanswered = busy = 0
    for a in answers:
        outcome = "no answer" if a.status is None else f"{a.status} {a.code or ''}".strip()
        by_kind.setdefault(a.kind, Counter())[outcome] += 1
        if a.status is None:
            unanswered += 1
            continue
        if a.status == 429:
            busy += 1
            continue
        if a.status == UPLOAD_EXPECT[a.kind]:
            continue
        if a.status == 503 and _during(a.began, a.t, outages, grace_s):
            continue
        violations.append({"t": a.t, "kind": a.kind, "expected": UPLOAD_EXPECT[a.kind],
                           "status": a.status, "code": a.code})  # fmt: skip
    return {
        "ok": not violations,
        "answers": len(answers),
        "by_kind": {k: dict(c) for k, c in by_kind.items()},
        "unanswered": unanswered,
        "busy": busy,
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def api_memory_invariant(samples: list[MemorySample], bound_mib: float) -> dict[str, Any]:
    """For each API process (pid), its baseline (the RSS of its last sample before the
    large-body senders first went to work, or its first sample) and its peak while they
    work: each sample's RSS then, and its high-water mark where that rose since the sample
    before (a peak between two samples). The peak may be at most ``bound_mib`` over the
    baseline. Processes never sampled with the senders at work are reported, not judged."""
    by_pid: dict[int, list[MemorySample]] = {}
    for sample in sorted(samples, key=lambda x: x.t):
        by_pid.setdefault(sample.pid, []).append(sample)
    processes: list[dict[str, Any]] = []
    violations: list[dict[str, Any]] = []
    for pid, rows in by_pid.items():
        entry: dict[str, Any] = {
            "pid": pid,
            "samples": len(rows),
            "from_t": round(rows[0].t, 1),
            "to_t": round(rows[-1].t, 1),
            "high_water_mib": round(max(r.hwm_kib for r in rows) / 1024, 1),
        }
        first = next((i for i, r in enumerate(rows) if r.active), None)
        if first is None:
            processes.append({**entry, "judged": False})
            continue
        base = rows[first - 1] if first else rows[0]
        peak = 0
        previous_hwm = base.hwm_kib if first else 0
        for r in rows[first:]:
            if r.active:
                peak = max(peak, r.rss_kib, r.hwm_kib if r.hwm_kib > previous_hwm else 0)
            previous_hwm = r.hwm_kib
        growth = (peak - base.rss_kib) / 1024
        entry.update(
            judged=True,
            baseline_mib=round(base.rss_kib / 1024, 1),
            peak_mib=round(peak / 1024, 1),
            growth_mib=round(growth, 1),
            active_samples=sum(1 for r in rows if r.active),
        )
        processes.append(entry)
        if growth > bound_mib:
            violations.append({"pid": pid, "baseline_mib": entry["baseline_mib"],
                               "peak_mib": entry["peak_mib"], "bound_mib": bound_mib})  # fmt: skip
    judged = [p for p in processes if p["judged"]]
    return {
        "ok": not violations,
        "bound_mib": bound_mib,
        "judged": len(judged),
        "peak_mib": max((p["peak_mib"] for p in judged), default=None),
        "growth_mib": max((p["growth_mib"] for p in judged), default=None),
        "high_water_mib": max((p["high_water_mib"] for p in processes), default=None),
        "processes": processes,
        "violations": violations,
        "violation_count": len(violations),
    }
