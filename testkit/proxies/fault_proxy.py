"""An HTTP reverse proxy on loopback that injects an upstream server's refusals on demand.

Put it in front of a real OpenAI-compatible server: it forwards every request as it came,
counts what passed and keeps each request's path and body (``received``).
``refuse(n, status, retry_after)`` answers the next ``n`` requests itself (429 or 503 with a
``Retry-After`` header, as a busy vLLM or a gateway does) without forwarding them. A client that disconnects while its request is forwarded closes the request upstream too
(the server sees its connection close, as vLLM needs to abort it). ``in_flight`` is the
requests forwarded and not yet answered; ``max_in_flight`` the most seen at once.
``hold()`` keeps every answer from the client (the request is forwarded and answered
upstream, the answer waits here) until ``release()``: the requests stay in flight however fast
the server answers, for a test that must act while they are.

(``testkit.proxies.tcp_proxy`` cuts and stalls connections; this one speaks HTTP.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import uvicorn

from cli.perf.service import free_port, wait_for

HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}


class FaultProxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")  # e.g. http://127.0.0.1:8000
        self.port = free_port()
        self.lock = threading.Lock()
        self.forwarded = 0
        self.refused = 0
        self.closed_by_client = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.received: list[tuple[str, bytes]] = []  # (path, body) of every request, in order
        self._refusals: list[tuple[int, float | None]] = []
        self._holding = False
        self._client: httpx.AsyncClient | None = None
        self._server = uvicorn.Server(
            uvicorn.Config(
                self._app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
                interface="asgi3",
            )  # fmt: skip
        )
        self._thread = threading.Thread(target=self._server.run, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        wait_for(lambda: self._server.started, 30, "the fault proxy")
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def refuse(self, n: int, status: int = 429, retry_after: float | None = 1.0) -> None:
        """Answer the next ``n`` requests with ``status`` (and ``Retry-After``) unforwarded."""
        with self.lock:
            self._refusals += [(status, retry_after)] * n

    def hold(self) -> None:
        """Keep every answer (forwarded ones included) until :meth:`release`."""
        self._holding = True

    def release(self) -> None:
        self._holding = False

    def reset_peak(self) -> None:
        with self.lock:
            self.max_in_flight = self.in_flight

    # -- the ASGI app

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        with self.lock:
            self.received.append((scope["path"], body))
            refusal = self._refusals.pop(0) if self._refusals else None
            if refusal is not None:
                self.refused += 1
        if refusal is not None:
            status, retry_after = refusal
            headers = [(b"content-type", b"application/json")]
            if retry_after is not None:
                headers.append((b"retry-after", f"{retry_after:g}".encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body",
                        "body": b'{"error": {"message": "the server is busy"}}'})  # fmt: skip
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None, trust_env=False)
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]
                   if k.decode().lower() not in HOP_HEADERS]  # fmt: skip
        path = scope["path"] + (
            f"?{scope['query_string'].decode()}" if scope["query_string"] else ""
        )
        request = self._client.build_request(
            scope["method"], self.target + path, headers=headers, content=body
        )
        with self.lock:
            self.in_flight += 1
            self.forwarded += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        forward = asyncio.ensure_future(self._forward(request))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
            if forward not in done:  # the client left: so does its request upstream
                forward.cancel()
                with self.lock:
                    self.closed_by_client += 1
                return
            status, answer_headers, content = forward.result()
        finally:
            gone.cancel()
            with self.lock:
                self.in_flight -= 1
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in answer_headers
                                if k.lower() not in HOP_HEADERS]})  # fmt: skip
        await send({"type": "http.response.body", "body": content})

    async def _forward(self, request: httpx.Request) -> tuple[int, list[tuple[str, str]], bytes]:
        assert self._client is not None
        response = await self._client.send(request, stream=True)
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        while self._holding:  # the client may leave meanwhile: the caller watches for that
            await asyncio.sleep(0.01)
        return response.status_code, list(response.headers.items()), content


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def wait_idle(proxy: FaultProxy, timeout: float) -> float:
    """Seconds until nothing is in flight through ``proxy`` (TimeoutError past ``timeout``)."""
    started = time.monotonic()
    wait_for(lambda: proxy.in_flight == 0, timeout, "the proxy's requests to end")
    return time.monotonic() - started
