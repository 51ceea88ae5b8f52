"""The host's record of one request (:class:`Entry`), its cost for fair sharing, and how its
future settles: every future resolves once, with an output or an error, and a future the
caller cancelled while it was pending is left alone."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestOutput, aborted_output
from engine.sampling_params import SamplingParams

PENDING, IN_FLIGHT = "pending", "in_flight"


@dataclass(slots=True, eq=False)
class Entry:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None
    future: Future
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    cost: int = 0  # tokens: prompt + expected output (max_tokens for each of n completions)
    state: str = PENDING
    abort_requested: bool = False
    suspended: Any = None  # the engine's handle while suspended for another tenant's share

    @property
    def flow(self) -> tuple[str | None, str | None, int]:
        """The fair queue this entry waits in: its tenant's batch at its priority."""
        return self.tenant, self.group, self.priority


def expected_tokens(prompt: list[int], params: SamplingParams) -> int:
    """A request's cost for fair sharing: its prompt plus the output it may generate."""
    n = max(1, int(getattr(params, "n", 1) or 1))
    return len(prompt) + n * int(getattr(params, "max_tokens", 0) or 0)


def abort_output(entry: Entry) -> RequestOutput:
    n = max(1, int(getattr(entry.params, "n", 1) or 1))
    return aborted_output(entry.request_id, entry.prompt_token_ids, n, entry.arrival_time)


def resolve(future: Future, output: RequestOutput) -> None:
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_result(output)


def fail(future: Future, error: BaseException, cause: BaseException | None = None) -> None:
    if cause is not None and error is not cause:
        error.__cause__ = cause
    if future.done():
        return
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(error)


def resolve_call(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)
