"""OpenAI's error envelope, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

Clients written against OpenAI read ``error.message`` and branch on the status code; FastAPI's
own 422 body and Starlette's plain-text errors would break them, so every path is mapped here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("batchd.api")

#: OpenAI's ``error.type`` for each status code we answer with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}

DATABASE_UNAVAILABLE = "The database is unavailable; please retry shortly."
#: A body that is not JSON, on a route that reads JSON (OpenAI's words).
JSON_INVALID = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
)
#: What FastAPI answers for a body it could not read as text (bytes that are not UTF-8).
BODY_UNREADABLE = "There was an error parsing the body"


class APIError(Exception):
    """An error answered to the client as it is (status, message, param, code)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status_code, "invalid_request_error")
        self.headers = headers


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param=param)


def envelope(
    status_code: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": type or ERROR_TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status_code, headers=headers)


#: Anthropic's ``error.type`` for each status code (the Messages routes answer in its envelope).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"


def respond(request: Request, status_code: int, message: str, **fields: Any) -> JSONResponse:
    """The error in the envelope the route's clients read: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, else OpenAI's."""
    if not request.url.path.startswith(ANTHROPIC_PATHS):
        return envelope(status_code, message, **fields)
    body = {
        "type": "error",
        "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(status_code, "api_error"),
            "message": message,
        },
    }
    return JSONResponse(body, status_code=status_code, headers=fields.get("headers"))


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """``("body", "metadata", "k")`` -> ``metadata.k``; the request part (body, query…) is dropped."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "query", "path", "header", "cookie"}:
        parts = parts[1:]
    return ".".join(parts) or None


def _validation_message(err: dict[str, Any], param: str | None) -> str:
    msg = str(err.get("msg", "Invalid value"))
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"Missing required parameter: '{param}'." if param else "Missing required parameter."
    if err.get("type") == "json_invalid":
        return JSON_INVALID
    return f"Invalid value for '{param}': {msg}" if param else msg


def is_database_unavailable(error: BaseException) -> bool:
    if isinstance(error, sa_exc.OperationalError | sa_exc.TimeoutError | sa_exc.InterfaceError):
        return True
    return isinstance(error, sa_exc.DBAPIError) and bool(error.connection_invalidated)


def api_error_response(request: Request, error: APIError) -> JSONResponse:
    """The answer to an :class:`APIError`, in the envelope of the route's family."""
    return respond(
        request,
        error.status_code,
        error.message,
        type=error.type,
        param=error.param,
        code=error.code,
        headers=error.headers,
    )


def database_error_response(request: Request, error: sa_exc.SQLAlchemyError) -> JSONResponse:
    """503 when the database is unavailable (a warning logged), else 500 (the error logged)."""
    if is_database_unavailable(error):
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, error)
        return respond(request, 503, DATABASE_UNAVAILABLE, code="database_unavailable")
    log.exception("database error on %s %s", request.method, request.url.path)
    return respond(request, 500, "The server had an error while processing your request.")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return api_error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = list(error.errors())
        first = errors[0] if errors else {}
        param = _param_from_loc(tuple(first.get("loc", ())))
        return respond(request, 400, _validation_message(first, param), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else "Request failed."
        if error.status_code == 404 and message == "Not Found":
            message = "Unknown request URL. Please check the URL and method."
        headers = getattr(error, "headers", None)
        return respond(request, error.status_code, message, headers=headers)

    @app.exception_handler(sa_exc.SQLAlchemyError)
    async def _database_error(request: Request, error: sa_exc.SQLAlchemyError) -> JSONResponse:
        return database_error_response(request, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(request, 500, "The server had an error while processing your request.")
