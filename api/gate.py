"""The door of every HTTP request: the caller is known from the headers before a byte of the
body is read, and the body is read under its route's byte limit.

FastAPI reads and parses a route's declared body before it resolves a single dependency, so a
key checked by a dependency protects nothing: a body of 800 MiB sent without a key was read
whole (and its processes grew by gigabytes) before the 401. :class:`RequestGate`, a pure ASGI
middleware (Starlette's ``BaseHTTPMiddleware`` would buffer), runs before the router:

1. A route that takes a key (its dependencies include :func:`api.deps.authenticate`) has the
   key checked here, with the per-key rate limit (:func:`api.deps.authenticate_request`, in
   the thread pool); a refusal (401, 403, 429, 503) is answered in the envelope of the route's
   family and the body is never read. The caller is left in ``request.state`` for the route.
2. Every route has a byte limit (:func:`route_limits`). A ``Content-Length`` over it is refused
   with 413 before reading; a body without one is counted as it streams and, at the limit, the
   gate answers 413 itself and the route sees the client go (``http.disconnect``).
3. A response that starts before its request's body was read to the end asks for the
   connection to close, so that the server does not read the rest of the body either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import RouteContext, iter_route_contexts
from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import CALLER_STATE, authenticate, authenticate_request
from api.errors import APIError, api_error_response, database_error_response
from api.uploads import MULTIPART_OVERHEAD, too_large
from core.settings import Settings

MIB = 1024 * 1024


def _size(limit: int) -> str:
    """``1048576`` -> ``1 MiB``; a limit that is not whole MiB in bytes."""
    if limit >= MIB and limit % (MIB // 4) == 0:
        return f"{limit / MIB:g} MiB"
    return f"{limit} bytes"


@dataclass(frozen=True, slots=True)
class BodyLimit:
    """The most bytes a route's request body may hold, and its 413."""

    bytes: int
    refusal: APIError


def body_too_large(limit: int, setting: str) -> APIError:
    return APIError(
        413,
        f"Request body too large: the limit for this route is {limit} bytes ({_size(limit)}, "
        f"{setting}).",
        code="request_too_large",
    )


def route_limits(settings: Settings) -> dict[tuple[str, str], BodyLimit]:
    """The routes whose bodies are not small JSON calls, by method and path template. Uploads
    answer as their own routes do when the file part is over its limit."""
    upload, part = settings.max_upload_bytes, settings.max_upload_part_bytes
    batch = settings.max_message_batch_bytes
    return {
        ("POST", "/v1/files"): BodyLimit(upload + MULTIPART_OVERHEAD, too_large(upload)),
        ("POST", "/v1/uploads/{upload_id}/parts"): BodyLimit(
            part + MULTIPART_OVERHEAD, too_large(part, "data")
        ),
        ("POST", "/v1/messages/batches"): BodyLimit(
            batch, body_too_large(batch, "max_message_batch_bytes")
        ),
    }


def default_limit(settings: Settings) -> BodyLimit:
    """Every other route's limit."""
    limit = settings.max_request_body_bytes
    return BodyLimit(limit, body_too_large(limit, "max_request_body_bytes"))


def takes_a_key(route: BaseRoute | RouteContext) -> bool:
    """Whether ``route`` depends, at any depth, on :func:`api.deps.authenticate` (with the
    dependencies of the routers that include it)."""
    root = getattr(route, "dependant", None)
    stack: list[Dependant] = [root] if isinstance(root, Dependant) else []
    while stack:
        dependant = stack.pop()
        if dependant.call is authenticate:
            return True
        stack.extend(dependant.dependencies)
    return False


@dataclass(frozen=True, slots=True)
class Door:
    """What the gate asks of one route's requests."""

    keyed: bool
    limit: BodyLimit


class RequestGate:
    """ASGI middleware: the caller from the headers, then the body under its route's limit."""

    def __init__(self, app: ASGIApp, settings: Settings, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.settings = settings
        self._routes = routes  # the app's own list: its routes are added after the middleware
        self._doors: list[tuple[RouteContext, Door]] | None = None
        self._default = Door(keyed=False, limit=default_limit(settings))

    def doors(self) -> list[tuple[RouteContext, Door]]:
        """Each route of the app with its door, in the router's order (made on first use; a
        route an app includes from a router is seen with that router's prefix)."""
        if self._doors is None:
            limits = route_limits(self.settings)
            doors = []
            for route in iter_route_contexts(self._routes):
                limit = self._default.limit
                for method in route.methods or ():
                    limit = limits.get((method, route.path_format or ""), limit)
                doors.append((route, Door(takes_a_key(route), limit)))
            self._doors = doors
        return self._doors

    def door(self, scope: Scope) -> Door:
        """The door of the route the router will choose (a route that matches only the path,
        not the method, answers 405 without the body or a key)."""
        for route, door in self.doors():
            match, _child = route.matches(scope)
            if match is Match.FULL:
                return door
        return self._default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        door = self.door(scope)
        exchange = _Exchange(scope, receive, send, door.limit)
        if door.keyed:
            request = Request(scope)
            try:
                caller = await run_in_threadpool(authenticate_request, request, self.settings)
            except APIError as error:
                await exchange.answer(api_error_response(request, error))
                return
            except SQLAlchemyError as error:
                await exchange.answer(database_error_response(request, error))
                return
            scope.setdefault("state", {})[CALLER_STATE] = caller
        if exchange.declared is not None and exchange.declared > door.limit.bytes:
            await exchange.refuse_body()
            return
        await self.app(scope, exchange.receive, exchange.send)


def _declared_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


class _Exchange:
    """One request's body, counted against its limit, and its response."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, limit: BodyLimit) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.limit = limit
        headers = Headers(scope=scope)
        self.declared = _declared_length(headers)
        #: The body has bytes the server has not read yet.
        self.unread = (
            self.declared > 0
            if self.declared is not None
            else "chunked" in headers.get("transfer-encoding", "").lower()
        )
        self.received = 0
        self.started = False
        self.cut = False  # the body was cut at the limit: the app is told the client left
        self.answered = False  # the gate answered: what the app sends goes nowhere

    async def receive(self) -> Message:
        if self.cut:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if not message.get("more_body", False):
            self.unread = False
        if self.received > self.limit.bytes:
            self.cut = True
            if not self.started:
                await self.refuse_body()
            return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if not self.answered:
            await self._forward(message)

    async def _forward(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers: list[Any] = list(message.get("headers", []))
            if self.unread and not any(name.lower() == b"connection" for name, _ in headers):
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
        await self._send(message)

    async def answer(self, response: Response) -> None:
        """Answer in the app's place; whatever the app sends afterwards is dropped."""
        self.answered = True
        await response(self.scope, self._receive, self._forward)

    async def refuse_body(self) -> None:
        await self.answer(api_error_response(Request(self.scope), self.limit.refusal))
