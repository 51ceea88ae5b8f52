"""No request body is read before its sender is known, and every body has a limit.

FastAPI reads a declared body before it resolves any dependency: a body of 800 MiB sent
without a key was read whole (the API's memory grew by 2.4 GB) before the 401, and the
Anthropic route parsed it first and answered 400. The gate (``api.gate``) checks the key from
the headers and counts the body against its route's limit; these tests send bodies that a
server reading them would have to pull whole, and count what it pulled.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from testkit.builders.lines import MODEL
from tests.api.conftest import Server

pytestmark = pytest.mark.services

MIB = 1024 * 1024
CHUNK = 64 * 1024
ANTHROPIC_VERSION = {"anthropic-version": "2023-06-01"}
JSON = {"content-type": "application/json"}
JSON_LIMIT = MIB  # BATCHD_MAX_REQUEST_BODY_BYTES's default
NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
JSON_INVALID = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
)
BOUNDARY = "gatetestboundary"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
MULTIPART_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
    "Content-Type: application/jsonl\r\n\r\n"
).encode()
#: What a server that refused a body unread may still have pulled from the client: its
#: read-ahead and both sockets' buffers on loopback (a few MiB; Linux lets a receive buffer
#: grow to ``net.ipv4.tcp_rmem``'s maximum, 32 MiB on some machines).
UNREAD_SLACK = 48 * MIB


class Pulled:
    """A streamed request body of ``total`` bytes (after ``head``), made as it is sent,
    counting the bytes the client was asked for."""

    def __init__(self, total: int, head: bytes = b"", fill: bytes = b"x") -> None:
        self.total = total
        self.head = head
        self.block = fill * CHUNK
        self.pulled = 0

    def __iter__(self) -> Iterator[bytes]:
        if self.head:
            self.pulled += len(self.head)
            yield self.head
        while self.pulled < self.total:
            block = self.block[: self.total - self.pulled]
            self.pulled += len(block)
            yield block


def _post(
    server: Server,
    path: str,
    body: Pulled | bytes,
    *,
    key: str | None = "",
    headers: dict[str, str] | None = None,
    length: int | None = None,
) -> httpx.Response:
    """POST ``body`` (a generator: chunked, unless ``length`` declares a Content-Length)."""
    sent = dict(headers or {})
    if length is not None:
        sent["content-length"] = str(length)
    content = iter(body) if isinstance(body, Pulled) else body
    with server.http(api_key=key) as http:
        return http.post(path, content=content, headers=sent)


def _openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def _anthropic_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    return body["error"]


# -- the key first


def test_no_key_or_a_wrong_key_is_401_before_a_byte_of_the_body_is_read(server: Server) -> None:
    total = 256 * MIB
    for key, message in ((None, NO_KEY), ("sk-bd-wrongwrongwrong", "Incorrect API key")):
        openai_body = Pulled(total)
        refused = _post(server, "/v1/batches", openai_body, key=key)
        error = _openai_error(refused, 401)
        assert str(error["message"]).startswith(message), error
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "invalid_api_key", None,
        )  # fmt: skip
        assert refused.headers["www-authenticate"] == "Bearer"
        assert openai_body.pulled < UNREAD_SLACK, openai_body.pulled

        anthropic_body = Pulled(total)
        headers = {**ANTHROPIC_VERSION, "content-type": "application/json"}
        refused = _post(server, "/v1/messages/batches", anthropic_body, key=key, headers=headers)
        error = _anthropic_error(refused, 401)  # was 400: the body was parsed first
        assert error["type"] == "authentication_error"
        assert str(error["message"]).startswith(message), error
        assert refused.headers["www-authenticate"] == "Bearer"
        assert anthropic_body.pulled < UNREAD_SLACK, anthropic_body.pulled

        upload = Pulled(total, MULTIPART_HEAD)
        refused = _post(server, "/v1/files", upload, key=key, headers=MULTIPART)
        assert _openai_error(refused, 401)["code"] == "invalid_api_key"
        assert upload.pulled < UNREAD_SLACK, upload.pulled
    # The key in x-api-key (Anthropic's SDK) is the same key: wrong there, the same 401.
    refused = _post(server, "/v1/messages/batches", Pulled(total), key=None,
                    headers={**ANTHROPIC_VERSION, "x-api-key": "sk-bd-nope-nope-nope"})  # fmt: skip
    assert _anthropic_error(refused, 401)["type"] == "authentication_error"
    # Public routes take no key, as before.
    with server.http(api_key=None) as http:
        assert http.get("/livez").status_code == 200
        assert http.get("/healthz").status_code == 200
        assert http.get("/metrics").status_code == 200


# -- then the body, under a limit


def test_a_declared_length_over_the_limit_is_413_unread(
    start_server: Callable[..., Server],
) -> None:
    server = start_server(BATCHD_MAX_MESSAGE_BATCH_BYTES=str(2 * MIB))
    declared = 512 * MIB
    body = Pulled(declared)
    refused = _post(server, "/v1/batches", body, length=declared)
    error = _openai_error(refused, 413)
    assert error["message"] == (
        "Request body too large: the limit for this route is 1048576 bytes (1 MiB, "
        "max_request_body_bytes)."
    )
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert body.pulled < UNREAD_SLACK, body.pulled

    body = Pulled(declared)
    headers = {**ANTHROPIC_VERSION, "content-type": "application/json"}
    refused = _post(server, "/v1/messages/batches", body, headers=headers, length=declared)
    error = _anthropic_error(refused, 413)
    assert error == {
        "type": "request_too_large",
        "message": "Request body too large: the limit for this route is 2097152 bytes (2 MiB, "
        "max_message_batch_bytes).",
    }
    assert body.pulled < UNREAD_SLACK, body.pulled

    # At the limit a body is read (and refused for what it holds), one byte over it is not.
    at_limit = _post(server, "/v1/batches", b"x" * JSON_LIMIT, headers=JSON)
    assert _openai_error(at_limit, 400)["message"] == JSON_INVALID
    over = _post(server, "/v1/batches", b"x" * (JSON_LIMIT + 1), headers=JSON)
    assert _openai_error(over, 413)["code"] == "request_too_large"
    with server.http() as http:  # a GET with a body has the same limit
        big_get = http.request("GET", "/v1/batches", content=b"x" * (JSON_LIMIT + 1))
    assert _openai_error(big_get, 413)["code"] == "request_too_large"
    client = server.client()
    assert client.batches.list().data == []  # and the routes still answer
    assert client.models.list().data is not None


def test_a_chunked_body_is_cut_at_the_limit(start_server: Callable[..., Server]) -> None:
    server = start_server(BATCHD_MAX_MESSAGE_BATCH_BYTES=str(2 * MIB))
    body = Pulled(256 * MIB)
    refused = _post(server, "/v1/batches", body)
    assert _openai_error(refused, 413)["code"] == "request_too_large"
    assert JSON_LIMIT < body.pulled < JSON_LIMIT + UNREAD_SLACK, body.pulled

    body = Pulled(256 * MIB)
    headers = {**ANTHROPIC_VERSION, "content-type": "application/json"}
    refused = _post(server, "/v1/messages/batches", body, headers=headers)
    error = _anthropic_error(refused, 413)
    assert error["type"] == "request_too_large"
    assert "2097152 bytes (2 MiB, max_message_batch_bytes)" in str(error["message"])
    assert 2 * MIB < body.pulled < 2 * MIB + UNREAD_SLACK, body.pulled

    # Exactly at the limit, chunked, the body is read.
    at_limit = _post(server, "/v1/batches", Pulled(JSON_LIMIT), headers=JSON)
    assert _openai_error(at_limit, 400)["message"] == JSON_INVALID
    with server.http(headers=ANTHROPIC_VERSION) as http:
        assert http.get("/v1/messages/batches").json()["data"] == []  # nothing was created


# -- Anthropic's create, read one request at a time


def _claude_post(server: Server, body: bytes | Pulled, **headers: str) -> httpx.Response:
    sent = {**ANTHROPIC_VERSION, "content-type": "application/json", **headers}
    return _post(server, "/v1/messages/batches", body, headers=sent)


def _request(custom_id: str, text: str = "hi", **params: object) -> dict[str, object]:
    return {
        "custom_id": custom_id,
        "params": {
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}],
            **params,
        },
    }  # fmt: skip


def _streamed(document: dict[str, object]) -> Iterator[bytes]:
    """``document`` as JSON, one request per chunk (never whole)."""
    requests = document.pop("requests")
    assert isinstance(requests, list)
    yield b'{"requests": ['
    for i, request in enumerate(requests):
        yield (b", " if i else b"") + json.dumps(request).encode()
    yield b"]"
    for name, value in document.items():
        yield f", {json.dumps(name)}: {json.dumps(value)}".encode()
    yield b"}"


def test_a_large_message_batch_is_taken_a_request_at_a_time(
    start_server: Callable[..., Server],
) -> None:
    server = start_server(
        BATCHD_MODELS=f'{{"{MODEL}": "demo:llama-tiny"}}',
        BATCHD_MAX_MESSAGE_BATCH_BYTES=str(4 * MIB),
    )
    requests = [_request(f"r{i}", f"{i} " + "long text " * 7000) for i in range(40)]
    requests[7] = _request("r7", tools=[{"name": "f"}])  # unservable: an errored result
    with server.http(headers={**ANTHROPIC_VERSION, "content-type": "application/json"}) as http:
        created = http.post("/v1/messages/batches", content=_streamed({"requests": list(requests)}))
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["processing_status"] == "in_progress"
    assert batch["request_counts"]["processing"] == 39
    assert batch["request_counts"]["errored"] == 1
    size = sum(len(json.dumps(r)) for r in requests)
    assert 2 * MIB < size < 4 * MIB

    # The chat lines that run it, in request order, the errored one left out.
    client = server.client()
    (stored,) = [f for f in client.files.list() if f.filename == "message_batch.jsonl"]
    lines = client.files.content(stored.id).text.splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == [
        f"r{i}" for i in range(40) if i != 7
    ]


PARSE_CASES = [
    # (body, content type, message): each as the whole body, parsed, got it before.
    (b"{not json", "application/json", JSON_INVALID),
    (b'{"requests": [1, 2] ', "application/json", JSON_INVALID),
    (b'{"requests": []} {}', "application/json", JSON_INVALID),
    (b"   ", "application/json", JSON_INVALID),
    (b'{"requests": ["\xff"]}', "application/json", "There was an error parsing the body"),
    (b"", "application/json", "requests: Field required (an array of {custom_id, params})."),
    (b"[1]", "application/json", "requests: Field required (an array of {custom_id, params})."),
    (b'{"requests": {}}', "application/json",
     "requests: Field required (an array of {custom_id, params})."),
    (b'{"requests": [5], "requests": 1}', "application/json",
     "requests: Field required (an array of {custom_id, params})."),
    (b'{"requests": []}', "text/plain",
     "requests: Field required (an array of {custom_id, params})."),
    (b'{"requests": [], "zeta": 1, "alpha": 2}', "application/json",
     "alpha: Extra inputs are not permitted"),
    (b'{"requests": [5], "zz": 1}', "application/json", "zz: Extra inputs are not permitted"),
    (b'{"requests": []}', "application/json", "requests: at least one request is required."),
    (b'{"requests": 1, "requests": []}', "application/vnd.api+json",
     "requests: at least one request is required."),
    ('{"requests": []}'.encode("utf-16"), "application/json",
     "requests: at least one request is required."),
    (json.dumps({"requests": [_request("a"), 5]}).encode(), "application/json",
     "requests.1: expected an object."),
    (json.dumps({"requests": [_request("a b")]}).encode(), "application/json",
     "requests.0.custom_id: must match ^[a-zA-Z0-9_-]{1,64}$."),
    (json.dumps({"requests": [_request("a"), _request("b"), _request("a")]}).encode(),
     "application/json",
     "requests.2.custom_id: 'a' is already the custom_id of request 0; custom_id must be "
     "unique within a batch."),
    (json.dumps({"requests": [{"custom_id": "a"}]}).encode(), "application/json",
     "requests.0.params: Field required"),
    (json.dumps({"requests": [5] + [_request(f"q{i}") for i in range(3)]}).encode(),
     "application/json", "requests: at most 3 requests per batch, got 4."),
]  # fmt: skip


def test_a_message_batch_create_answers_what_it_answered_before(
    start_server: Callable[..., Server],
) -> None:
    server = start_server(
        BATCHD_MODELS=f'{{"{MODEL}": "demo:llama-tiny"}}', BATCHD_MAX_REQUESTS_PER_BATCH="3"
    )
    failures = []
    for body, content_type, message in PARSE_CASES:
        for sent in (body, Pulled(len(body), body) if body else body):  # whole, and chunked
            response = _claude_post(server, sent, **{"content-type": content_type})
            error = _anthropic_error(response, 400)
            if error != {"type": "invalid_request_error", "message": message}:
                failures.append((body[:60], error))
    assert not failures, failures
    ok = _claude_post(server, json.dumps({"requests": [_request("a"), _request("b")]}).encode())
    assert ok.status_code == 200, ok.text
    assert ok.json()["request_counts"]["processing"] == 2
    no_version = _post(server, "/v1/messages/batches", b"{}",
                       headers={"content-type": "application/json"})  # fmt: skip
    assert "anthropic-version" in str(_anthropic_error(no_version, 400)["message"])


# -- what stays as it was


def test_the_key_is_looked_up_and_charged_once(start_server: Callable[..., Server]) -> None:
    """The gate's check is the route's: a key's rate limit is charged once per request."""
    server = start_server(BATCHD_RATE_LIMIT_PER_MINUTE="3")
    with server.http() as http:
        statuses = [http.get("/v1/models").status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429], statuses
    with server.http(api_key=None) as http:  # no key: 401 before any bucket is charged
        assert http.get("/v1/models").status_code == 401


def test_every_route_that_takes_a_key_is_gated(service_env: dict[str, str]) -> None:
    """The gate finds the routes whose dependencies ask for a key, and its table of limits
    names routes that exist."""
    from fastapi.routing import iter_route_contexts

    from api.app import create_app
    from api.gate import RequestGate, route_limits, takes_a_key
    from core.settings import get_settings

    settings = get_settings().model_copy(update={"metrics_enabled": False})
    app = create_app(settings)
    (gate,) = [m for m in app.user_middleware if m.cls is RequestGate]
    assert gate.kwargs["routes"] is app.routes
    keyed, public = set(), set()
    for route in iter_route_contexts(app.routes):
        for method in route.methods or ():
            (keyed if takes_a_key(route) else public).add((method, route.path_format))
    assert {path for _method, path in keyed} >= {
        "/v1/files", "/v1/batches", "/v1/batches/{batch_id}", "/v1/models",
        "/v1/uploads/{upload_id}/parts", "/v1/messages/batches", "/v1/batches/estimate",
    }  # fmt: skip
    assert all(path.startswith("/v1/") for _method, path in keyed)
    assert {path for _method, path in public if path.startswith("/v1/")} == set()
    assert {("GET", "/healthz"), ("GET", "/livez"), ("POST", "/ui/login")} <= public
    assert set(route_limits(settings)) <= keyed


# -- the process, measured


@dataclass
class Exchange:
    """One streamed request as the client saw it."""

    status: int | None = None
    sent: int = 0
    #: Seconds from the moment the client had sent ``mark`` body bytes (0: from the start)
    #: to the first byte of the answer.
    answered_after_s: float | None = None
    body: bytes = b""


def _server_rss(pid: int) -> int:
    """VmRSS of ``pid`` and its descendants, in bytes."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines()
                      if line.startswith("VmRSS:"))  # fmt: skip
        pending += [int(child) for child in children]
    return total


@dataclass
class RssWatch:
    """Samples a server's RSS every few milliseconds in a thread, from a baseline."""

    pid: int
    before: int = 0
    peak: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> RssWatch:
        self.before = self.peak = _server_rss(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _server_rss(self.pid))
            self.samples += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _server_rss(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.before


#: The answer must come within this of the limit being reached (the client's send of the
#: limit's last byte; the server may still have a socket buffer to read).
ANSWER_WITHIN_S = 1.0
#: A server that grows past this is reading the body: stop sending (a machine is shared).
RUNAWAY_GROWTH = 256 * MIB


def _stream(
    server: Server, path: str, headers: dict[str, str], total: int, *, mark: int,
    head: bytes = b"", watch: RssWatch,
) -> Exchange:  # fmt: skip
    """POST a chunked body of ``total`` bytes, made as it is sent, until the server answers
    or closes; the client reads whenever the socket is readable, as a client that stops
    sending when answered does."""
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    request = f"POST {path} HTTP/1.1\r\nhost: {url.hostname}\r\ntransfer-encoding: chunked\r\n"
    request += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    sock.sendall(request.encode())
    sock.setblocking(False)
    block = b"x" * (256 * 1024)
    frame = f"{len(block):x}\r\n".encode() + block + b"\r\n"
    pending = memoryview(f"{len(head):x}\r\n".encode() + head + b"\r\n" if head else b"")
    exchange = Exchange()
    body_sent = len(head)
    started = time.monotonic()
    marked = started if mark == 0 else None
    answer = bytearray()
    writing = True
    ended = False
    try:
        while time.monotonic() - started < 120:
            assert watch.peak - watch.before < RUNAWAY_GROWTH, "the server is reading the body"
            readable, writable, _ = select.select([sock], [sock] if writing else [], [], 0.25)
            if readable:
                try:
                    data = sock.recv(1 << 16)
                except ConnectionResetError:
                    data = b""
                if not data:
                    break
                if not answer and marked is not None:
                    exchange.answered_after_s = time.monotonic() - marked
                answer += data
                head_end = answer.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = next((int(line.split(b":")[1]) for line in
                                   answer[:head_end].split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                    if len(answer) >= head_end + 4 + length:
                        break
                continue
            if writable:
                if not pending:
                    if ended:  # the last chunk is out: only read from now on
                        writing = False
                        continue
                    if body_sent >= total:
                        pending, ended = memoryview(b"0\r\n\r\n"), True
                        continue
                    pending = memoryview(frame)
                    body_sent += len(block)
                    if marked is None and body_sent >= mark:
                        marked = time.monotonic()
                try:
                    pending = pending[sock.send(pending) :]
                except (BrokenPipeError, ConnectionResetError):
                    writing = False  # the server closed: what it answered is still readable
    finally:
        sock.close()
    exchange.sent = body_sent
    if answer:
        status_line = bytes(answer).split(b"\r\n", 1)[0]
        exchange.status = int(status_line.split()[1])
        exchange.body = bytes(answer[answer.find(b"\r\n\r\n") + 4 :])
    return exchange


def test_a_gigabyte_body_moves_the_servers_memory_by_megabytes(
    start_server: Callable[..., Server],
) -> None:
    """1 GiB streamed, made on the fly, with and without a key, to the routes that read JSON,
    Anthropic's create and the file upload: the server answers 401 at once or 413 at the
    route's limit, and its memory (VmRSS of its processes, sampled while the body streams,
    and its peak, VmHWM) moves by a few MiB."""
    big_limit = 8 * MIB
    server = start_server(
        BATCHD_MAX_MESSAGE_BATCH_BYTES=str(big_limit), BATCHD_MAX_UPLOAD_BYTES=str(big_limit)
    )
    keyed = {"authorization": f"Bearer {server.api_key}"}
    anthropic = {**ANTHROPIC_VERSION, "content-type": "application/json"}
    gib = 1024 * MIB
    cases = [
        ("/v1/batches", {"content-type": "application/json"}, 401, 0, b""),
        ("/v1/batches", {**keyed, "content-type": "application/json"}, 413, JSON_LIMIT, b""),
        ("/v1/messages/batches", anthropic, 401, 0, b""),
        ("/v1/messages/batches", {**keyed, **anthropic}, 413, big_limit, b""),
        ("/v1/files", MULTIPART, 401, 0, MULTIPART_HEAD),
        ("/v1/files", {**keyed, **MULTIPART}, 413, big_limit, MULTIPART_HEAD),
    ]
    # Warm each path once with a small body (first-use imports, pools, threads).
    for path, headers, _status, limit, head in cases:
        _stream(server, path, headers, limit + 2 * MIB, mark=0, head=head,
                watch=RssWatch(server.pid))  # fmt: skip
    time.sleep(0.5)
    hwm_before = server.status("VmHWM")
    figures = []
    for path, headers, status, limit, head in cases:
        with RssWatch(server.pid) as watch:
            exchange = _stream(server, path, headers, gib, mark=limit, head=head, watch=watch)
        since = "the limit" if limit else "the start"
        figures.append(
            f"{path} {'key' if 'authorization' in headers else 'no key'}: {exchange.status} "
            f"after {exchange.sent / MIB:.1f} MiB sent, answered "
            f"{exchange.answered_after_s or 0:.3f} s after {since}; RSS "
            f"{watch.before / MIB:.1f} -> peak {watch.peak / MIB:.1f} MiB "
            f"(+{watch.growth / MIB:.1f} MiB, {watch.samples} samples)"
        )
        print(figures[-1])
        assert exchange.status == status, (figures[-1], exchange.body[:300])
        assert exchange.sent < gib // 4, figures[-1]
        assert exchange.answered_after_s is not None
        assert exchange.answered_after_s < ANSWER_WITHIN_S, figures[-1]
        assert watch.growth < 64 * MIB, figures[-1]
    hwm_growth = server.status("VmHWM") - hwm_before
    print(f"VmHWM grew by {hwm_growth / MIB:.1f} MiB over all six")
    assert hwm_growth < 64 * MIB, hwm_growth
