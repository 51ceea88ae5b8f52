"""The host's record of one request: its :class:`Entry`, its cost, and how its future settles.

Every future resolves once, with an output or an error; one its caller cancelled while pending
is left alone. An ``n > 1`` request is split into ``n`` entries of one completion each
(:func:`split`), which hold ``n`` slots like any other work; its :class:`Fanout` gathers their
outputs into one (or the first error) for its caller (docs/engine.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, aborted_output
from engine.core.sampling_params import SamplingParams

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
    deadline: float | None = None  # its batch's deadline (unix seconds): earliest first in a tenant
    state: str = PENDING
    abort_requested: bool = False
    suspended: Any = None  # the engine's handle while suspended for another tenant's share
    fanout: Fanout | None = None  # the n > 1 request this entry is one completion of
    index: int = 0  # which completion of it (the engine's completion_index)
    lora: str | None = None  # the LoRA adapter its rows apply (None: the base model)

    @property
    def flow(self) -> tuple[str | None, str | None, int]:
        """The fair queue this entry waits in: its tenant's batch at its priority."""
        return self.tenant, self.group, self.priority


@dataclass(slots=True, eq=False)
class Fanout:
    """An ``n > 1`` request split into ``n`` single-completion entries: the caller's future
    and what its completions have settled with so far. It holds no entry (an entry refers to
    it), so nothing of it outlives its entries and its caller's future."""

    request_id: str
    prompt_token_ids: list[int]
    n: int
    future: Future  # the caller's
    arrival_time: float
    live: int = 0  # its entries the host still holds (pending or in flight)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # completion 0's: the others read the prompt it computed
    failed: bool = False

    def member_ids(self) -> list[str]:
        return [member_id(self.request_id, i) for i in range(self.n)]

    def settle(
        self, index: int, output: RequestOutput | None, error: BaseException | None
    ) -> tuple[RequestOutput | None, BaseException | None]:
        """Completion ``index`` ended with ``output`` or ``error``. Returns the request's
        output once every completion has one, or its error the first time one fails (the
        rest then settle with nothing)."""
        if self.failed:
            return None, None
        if error is not None or output is None:
            self.failed = True
            self.completions = {}
            return None, error
        completion = output.outputs[0] if output.outputs else None
        if completion is None:  # the engine reported nothing for it: an abort
            completion = CompletionOutput(index=index, text="", token_ids=[], finish_reason="abort")
        completion.index = index
        self.completions[index] = completion
        m = output.metrics
        if m.first_token_time is not None:
            self.first_token_time = min(
                self.first_token_time or m.first_token_time, m.first_token_time
            )
        if m.finished_time is not None:
            self.finished_time = max(self.finished_time or 0.0, m.finished_time)
        if index == 0:
            self.num_cached_tokens = m.num_cached_tokens
        if len(self.completions) < self.n:
            return None, None
        completions, self.completions = self.completions, {}
        merged = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completions[i] for i in sorted(completions)],
            finished=True,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=self.first_token_time,
                finished_time=self.finished_time,
                num_cached_tokens=self.num_cached_tokens,
            ),
        )
        return merged, None


def member_id(request_id: str, index: int) -> str:
    """The engine's request id of completion ``index`` of a split request."""
    return f"{request_id}#{index}"


def split(entry: Entry) -> tuple[Fanout, list[Entry]]:
    """``entry`` (``n > 1``) as a :class:`Fanout` and its ``n`` single-completion entries:
    completion ``i`` samples with ``seed + i`` (the engine's ``completion_index``). Completion
    0 costs the prompt and its output; the others only their output, as they read the prompt
    from the prefix cache (the cost an unsplit request had, spread over its completions)."""
    n = entry.params.n
    fanout = Fanout(entry.request_id, entry.prompt_token_ids, n, entry.future, entry.arrival_time)
    single = dataclasses.replace(entry.params, n=1)
    members = [
        dataclasses.replace(
            entry,
            request_id=member_id(entry.request_id, i),
            params=single,
            future=Future(),
            cost=expected_tokens(entry.prompt_token_ids if i == 0 else [], single),
            fanout=fanout,
            index=i,
        )
        for i in range(n)
    ]
    fanout.live = n
    return fanout, members


def expected_tokens(prompt: list[int], params: SamplingParams) -> int:
    """A request's cost for fair sharing: its prompt plus the output it may generate."""
    n = max(1, int(getattr(params, "n", 1) or 1))
    return len(prompt) + n * int(getattr(params, "max_tokens", 0) or 0)


def abort_output(entry: Entry) -> RequestOutput:
    if entry.fanout is not None:  # one completion of a split request
        out = aborted_output(entry.request_id, entry.prompt_token_ids, 1, entry.arrival_time)
        out.outputs[0].index = entry.index
        return out
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


def claim(entry: Entry) -> bool:
    """Mark the caller's future running as ``entry`` is admitted; False if the caller
    cancelled it (or, for a completion of a split request, if the request already failed)."""
    if entry.fanout is None:
        return entry.future.set_running_or_notify_cancel()
    caller = entry.fanout.future
    if not caller.running():
        try:
            if not caller.set_running_or_notify_cancel():
                return False
        except RuntimeError:  # already failed, by another of its completions
            return False
    return entry.future.set_running_or_notify_cancel()
