"""Each endpoint's request body, checked and normalised into a :class:`BatchRequest`: the
fields each accepts and those refused (``fields``), one module per endpoint (``generation``:
chat and completions; ``embeddings``; ``responses``), their shared field checks (``checker``),
structured-output formats (``structured``) and chat tools (``tools``)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from core.batchfile.bodies.checker import Checker
from core.batchfile.bodies.embeddings import check_embedding
from core.batchfile.bodies.fields import FIELDS, UPSTREAM_RESERVED
from core.batchfile.bodies.generation import check_chat, check_completion
from core.batchfile.bodies.responses import check_response
from core.batchfile.request import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    RESPONSES_URL,
    BatchRequest,
    RequestKind,
)

KINDS: dict[str, RequestKind] = {
    CHAT_URL: "chat",
    COMPLETIONS_URL: "completion",
    EMBEDDINGS_URL: "embedding",
    RESPONSES_URL: "response",
}
_CHECKS: dict[RequestKind, Callable[[Checker, BatchRequest], None]] = {
    "chat": check_chat,
    "completion": check_completion,
    "embedding": check_embedding,
    "response": check_response,
}


_ACCEPTED = {kind: frozenset(names) for kind, names in FIELDS.items()}


def check_body(
    req: BatchRequest, *, forwarded: bool = False, allowed: Collection[str] = ()
) -> None:
    """Check ``req.body`` for ``req.kind`` and fill in the normalised fields; raises
    :class:`core.batchfile.request.LineError` naming the line and field of the first problem.

    A field outside the endpoint's :data:`core.batchfile.bodies.fields.FIELDS` is the first problem
    (``unknown_parameter``), unless the body is ``forwarded`` unchanged to an upstream server,
    which decides what it accepts; the fields this service knows are checked either way. A
    forwarded body may not set a field of :data:`~core.batchfile.bodies.fields.UPSTREAM_RESERVED`
    other than those the operator ``allowed`` for its upstream."""
    checker = Checker(req.line, req.body, forwarded=forwarded)
    if forwarded:
        _refuse_reserved(checker, allowed)
    else:
        checker.known(_ACCEPTED[req.kind])
    _CHECKS[req.kind](checker, req)


def _refuse_reserved(checker: Checker, allowed: Collection[str]) -> None:
    for name, why in UPSTREAM_RESERVED.items():
        if name not in allowed and checker.get(name) is not None:
            raise checker.fail(
                "unsupported_parameter",
                f"body.{name}",
                f"body.{name} is not forwarded to this upstream model: it {why} (the operator "
                f"may allow it with allow_fields={name} in the model's spec)",
            )
