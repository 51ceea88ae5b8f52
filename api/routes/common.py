"""Helpers shared by the routers: error response docs and keyset pagination."""

from __future__ import annotations

import re
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from api.schemas import ErrorResponse

Page = TypeVar("Page", bound=BaseModel)


def error_responses(*codes: int, authenticated: bool = True) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all in the error envelope.
    Authenticated routes can also answer 401 (no or bad key) and 429 (the key's rate limit)."""
    descriptions = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        403: "Not allowed for this API key",
        404: "No such object",
        409: "Conflict with the object's current state",
        413: "Upload too large",
        429: "Rate limit or quota reached",
        500: "Unexpected server error",
        503: "Database or broker unavailable",
    }
    return {
        code: {"model": ErrorResponse, "description": descriptions.get(code, "Error")}
        for code in (*codes, *((401, 429) if authenticated else ()), 500, 503)
    }


_OBJECT_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def could_be_id(value: str) -> bool:
    """Whether ``value`` has the shape of an id this service issues. Anything else cannot name
    an object, and is answered as missing without a query (NUL bytes or lone surrogates would
    make the database refuse it with an error)."""
    return _OBJECT_ID.fullmatch(value) is not None


def keyset_page(
    session: Session, query: Select[Any], model: Any, cursor: Any, *, descending: bool, limit: int
) -> tuple[list[Any], bool]:
    """Up to ``limit`` rows of ``query`` in ``(created_at, id)`` order, newest first when
    ``descending``, after the ``cursor`` row (None: from the first); and whether more follow."""
    created, ident = model.created_at, model.id
    if cursor is not None:
        if descending:
            query = query.where(
                or_(
                    created < cursor.created_at,
                    and_(created == cursor.created_at, ident < cursor.id),
                )
            )
        else:
            query = query.where(
                or_(
                    created > cursor.created_at,
                    and_(created == cursor.created_at, ident > cursor.id),
                )
            )
    order = (created.desc(), ident.desc()) if descending else (created.asc(), ident.asc())
    rows = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_page(page: type[Page], data: list[Any], has_more: bool) -> Page:
    """OpenAI's list object around ``data``: its first and last ids, and ``has_more``."""
    return page(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )
