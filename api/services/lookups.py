"""What the services share: the shape of an id this service issues, and keyset pagination."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

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
