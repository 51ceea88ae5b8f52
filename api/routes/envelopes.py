"""What the routers share: the error responses they document, and OpenAI's list object."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

from api.schemas import ErrorResponse

Page = TypeVar("Page", bound=BaseModel)


def error_responses(*codes: int, authenticated: bool = True) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all in the error envelope.
    Authenticated routes can also answer 401 (no or bad key), 413 (a body over the route's
    limit, see :mod:`api.gate`) and 429 (the key's rate limit)."""
    descriptions = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        403: "Not allowed for this API key",
        404: "No such object",
        408: "The request body stalled or arrived too slowly",
        409: "Conflict with the object's current state",
        413: "Request body too large for the route's limit",
        429: "Rate limit or quota reached",
        500: "Unexpected server error",
        503: "Database or broker unavailable",
    }
    return {
        code: {"model": ErrorResponse, "description": descriptions.get(code, "Error")}
        for code in (*codes, *((401, 413, 429) if authenticated else ()), 500, 503)
    }


def list_page(page: type[Page], data: list[Any], has_more: bool) -> Page:
    """OpenAI's list object around ``data``: its first and last ids, and ``has_more``."""
    return page(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )
