"""What a handler promises a shard's run: the :class:`Handler` protocol and the outcomes it
reads back for each request (:data:`RequestOutcome`). The handlers themselves are in
:mod:`worker.shards.handlers` and :mod:`worker.upstream.handler`.

A room of its own below both (beside :mod:`worker.host_contract`), so that the shard code may choose
the upstream handler and the upstream handler may answer in these terms without a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from core.batchfile.request import BatchRequest
from core.batchfile.results import GenerationResult

SUBMIT_WAIT_S = 0.25


class EngineUnavailable(RuntimeError):
    """The engine host of this process is dead: the attempt fails and the shard is reclaimed
    (by a healthy worker) once its heartbeat goes stale."""


@dataclass(frozen=True, slots=True)
class Line:
    """The request's line: an output line with its ``result`` (for usage) and the time the
    engine finished it, or an error line (``result`` None)."""

    record: dict[str, Any]
    result: GenerationResult | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class Aborted:
    """The host stopped the request before it finished: a cancel, or something to run again;
    ``record`` is its error line if nobody runs it again."""

    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine refused the request (its ``RequestError``): worth submitting again."""

    exc: BaseException


@dataclass(frozen=True, slots=True)
class Failed:
    """The host's run of the request failed (a failed engine step or embedding round)."""

    exc: BaseException


# What the host made of one request.
RequestOutcome = Line | Aborted | Refused | Failed


class Handler(Protocol):
    # Whether a failure may be a bystander's, to be run again alone (ShardRun's suspects),
    # rather than run again among the others.
    isolates_failures: bool
    # Whether the bodies go to their server as written (an upstream model): their lines may
    # hold fields this service does not know (core.batchfile.bodies.check_body).
    forwards_bodies: bool

    def prepare(self, req: BatchRequest) -> tuple[Any, Any] | Line:
        """The request's engine input ``(prompt, params)``, or its error line."""
        ...

    def submit(self, prompt: Any, params: Any, done: Callable[[Future], None]) -> None:
        """Hand one request to the host (``done`` gets its future); ``TimeoutError`` when
        the host's queue stays full, ``ValueError`` when it refuses the request,
        :class:`EngineUnavailable` when the host is dead."""
        ...

    def outcome(self, req: BatchRequest, future: Future, submitted: float | None) -> RequestOutcome:
        """What the host made of the request; raises :class:`EngineUnavailable` when the
        host is dead."""
        ...

    def failed_line(self, req: BatchRequest, exc: BaseException, tries: int) -> dict[str, Any]:
        """The error line of a request that failed every try."""
        ...

    def drained(self, timeout: float) -> bool:
        """Whether the host has nothing pending or in flight (asked of a handler that isolates
        failures, before a suspect runs alone); ``TimeoutError`` when the host does not answer
        within ``timeout``, :class:`EngineUnavailable` when it is dead."""
        ...
