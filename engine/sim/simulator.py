"""A simulated engine for load tests: the real engine's interface and statistics, no model.

``SimEngine`` admits requests, produces deterministic filler tokens at a configured rate and
reports them as :class:`engine.Engine` does, so the whole service can be driven at fleet rates
on a CPU. It is the model spec ``sim:`` (e.g. ``sim:tokens_per_s=4000,ttft_ms=50``). Its
virtual clock never runs faster than the configured rate, and a call costs work per event,
never per token. Clock and statistics: docs/engine.md ("The simulated engine"); who runs:
``engine.sim.scheduler``; what each completion is: ``engine.sim.requests``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections import deque
from typing import Any

from engine.core.config import DEFAULT_MAX_NUM_SEQS_ACCELERATOR, EngineConfig
from engine.core.outputs import (
    EngineStats,
    RequestMetrics,
    RequestOutput,
)
from engine.core.sampling_params import SamplingParams, check_new_request, check_resume
from engine.core.stats import EngineMetrics
from engine.core.step_cost import StepCostCurve
from engine.sim.requests import Completions, SimRequest, SimSeq, prompt_hash
from engine.sim.scheduler import SimScheduler

log = logging.getLogger("engine.sim")

DEFAULT_MAX_MODEL_LEN = 8192
LENGTHS = ("max", "hash")
MIN_CALL_S = 0.002  # a step() call covers at least this much virtual time...
MAX_CALL_S = 0.02  # ...and at most this much, so new work and aborts wait no longer
MAX_LAG_S = 0.05  # a call that starts later than this after the clock's due time restarts it


class SimEngine:
    """The engine interface of :class:`engine.Engine` over a simulated model (module
    docstring). ``tokenizer`` is a Hugging Face tokenizer or the directory of one;
    ``tokens_per_s`` is the per-sequence decode rate (virtual steps per second); ``ttft_ms``
    the first-token latency after admission; ``lengths`` "max" or "hash"; ``config`` any
    :class:`EngineConfig` field (``max_num_seqs``, ``max_model_len``, ``block_size`` and
    ``enable_metrics`` are used; the rest are accepted for the real engine's options)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tokens_per_s: float,
        ttft_ms: float,
        lengths: str = "max",
        **config: Any,
    ) -> None:
        if isinstance(tokens_per_s, bool) or not (
            isinstance(tokens_per_s, int | float) and 0 < tokens_per_s < math.inf
        ):
            raise ValueError(f"tokens_per_s must be a positive number, got {tokens_per_s!r}")
        if isinstance(ttft_ms, bool) or not (
            isinstance(ttft_ms, int | float) and 0 <= ttft_ms < math.inf
        ):
            raise ValueError(f"ttft_ms must be a number >= 0, got {ttft_ms!r}")
        if lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, got {lengths!r}")
        given = EngineConfig.from_kwargs(**config)
        max_num_seqs = given.max_num_seqs or DEFAULT_MAX_NUM_SEQS_ACCELERATOR
        max_model_len = given.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.config = dataclasses.replace(
            given, max_num_seqs=max_num_seqs, max_model_len=max_model_len
        )
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        if isinstance(tokenizer, str):
            from engine.text.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.tokens_per_s = float(tokens_per_s)
        self.ttft_ms = float(ttft_ms)
        self.lengths = lengths
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.scheduler = SimScheduler(max_num_seqs)
        self.metrics = EngineMetrics() if self.config.enable_metrics else None
        self.step_cost = StepCostCurve(max_num_seqs)  # flat: the host's urgent guard holds none
        self.requests: dict[str, SimRequest] = {}
        self._aborted: list[RequestOutput] = []
        self._ttft_steps = max(1, math.ceil(self.ttft_ms * self.tokens_per_s / 1000 - 1e-9))
        self._min_steps = max(1, round(MIN_CALL_S * self.tokens_per_s))
        self._max_steps = max(self._min_steps, round(MAX_CALL_S * self.tokens_per_s))
        self.completions = Completions(tokenizer, self.max_model_len, lengths)
        self._seq_ids = itertools.count()
        self._step = 0  # virtual steps done
        self._due: float | None = None  # when (perf_counter) the last virtual step is due
        self._live = 0  # running sequences past their first token and not finished
        self._finishes: list[tuple[int, int, int]] = []  # (last step, seq id, epoch) heap
        self._starts: deque[tuple[int, int, int]] = deque()  # (first step, seq id, epoch)
        self._total_prompt_tokens = 0
        blocks_per_seq = -(-self.max_model_len // self.config.block_size)
        self._stats = EngineStats(kv_blocks_total=blocks_per_seq * max_num_seqs)
        log.info(
            "simulated engine ready: %g tokens/s per sequence, max_num_seqs %d, ttft %g ms, "
            "max_model_len %d, lengths %s",
            self.tokens_per_s,
            max_num_seqs,
            self.ttft_ms,
            self.max_model_len,
            lengths,
        )

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        completion_index: int = 0,
    ) -> None:
        """Queue a request (``Engine.add_request``: same arguments, same refusals)."""
        params, prompt = check_new_request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt,
            completion_index,
            self.requests,
            self.vocab_size,
            self.max_model_len,
        )
        h = prompt_hash(prompt)
        request = SimRequest(
            request_id, prompt, params, RequestMetrics(arrival_time=time.time()), h
        )
        request.admitted = completion_index > 0  # counted by completion 0
        room = self.max_model_len - len(prompt)
        indexes = range(params.n) if params.n > 1 else (completion_index,)
        for index in indexes:
            length, reason = self.completions.length(h, index, params, room)
            seq = SimSeq(next(self._seq_ids), request, index, int(priority), length, reason)
            request.seqs.append(seq)
            self.scheduler.waiting.push(seq)
        request.num_unfinished = len(request.seqs)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; the next ``step()`` reports it with the tokens it has."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.status != "finished":
                seq.num_tokens = self._leave(seq)
                seq.status, seq.finish_reason = "finished", "abort"
        request.metrics.finished_time = time.time()
        self._aborted.append(self.completions.output(request))
        request.seqs = []
        return True

    def suspend_request(self, request_id: str) -> SimRequest | None:
        """Take an unfinished single-completion request out, keeping its tokens
        (``Engine.suspend_request``); None for an unknown, finished or ``n > 1`` one."""
        request = self.requests.get(request_id)
        if request is None or len(request.seqs) != 1 or request.params.n != 1:
            return None
        (seq,) = request.seqs
        if seq.status == "finished":
            return None
        seq.done = self._leave(seq)
        seq.status = "suspended"
        del self.requests[request_id]
        self._stats.num_suspended += 1
        return request

    def resume_request(self, request: SimRequest) -> None:
        """Put back a request that :meth:`suspend_request` took out: first in line."""
        (seq,) = request.seqs
        check_resume(request.request_id, self.requests, seq.status == "suspended")
        self.requests[request.request_id] = request
        self.scheduler.waiting.push(seq, front=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, advance the clock over a few virtual steps, report what finished."""
        start = time.perf_counter()
        wall = time.time()
        finished, self._aborted = self._aborted, []
        for seq in self.scheduler.to_preempt():
            seq.done = self._leave(seq)
            self.scheduler.waiting.push(seq, front=True)
            self.scheduler.num_preemptions += 1
        prefill = sum(self._run(seq) for seq in self.scheduler.admit())
        s = self._stats
        running = len(self.scheduler.running)
        if not running:
            s.num_steps += 1
            s.last_step_tokens = 0
            s.total_step_time_s += time.perf_counter() - start
            return finished
        k = self._call_steps()
        produced, fresh, done = self._advance(k)
        tokens = prefill + produced
        s.num_steps += k
        s.last_step_tokens = round(tokens / k)
        s.total_scheduled_tokens += tokens
        s.total_running_seq_steps += running * k
        s.total_output_tokens += produced
        if self._due is None or start - self._due > MAX_LAG_S:
            self._due = start  # idle (or far behind) since the last call: the clock restarts
        self._due += k / self.tokens_per_s
        remaining = self._due - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        elapsed = time.perf_counter() - start
        s.total_step_time_s += elapsed
        s.total_forward_time_s += elapsed
        self.step_cost.observe(running, round(produced / k), elapsed / k)
        self._stamp(wall, time.time(), elapsed / k, fresh, done)
        if self.metrics is not None:
            self._observe(elapsed / k, k, tokens, produced - len(fresh), done)
        return finished + done

    def _call_steps(self) -> int:
        """How many virtual steps this call covers: up to the next finish, within bounds."""
        heap, running = self._finishes, self.scheduler.running
        while heap and _stale(heap[0], running):
            heapq.heappop(heap)
        until = heap[0][0] - self._step if heap else self._max_steps
        return min(max(until, self._min_steps), self._max_steps)

    def _advance(self, k: int) -> tuple[int, list[SimSeq], list[RequestOutput]]:
        """Move the clock ``k`` virtual steps; returns (tokens produced, the sequences that
        produced their first token, the outputs of the requests that finished)."""
        s0, s1 = self._step, self._step + k
        running = self.scheduler.running
        produced = self._live * k
        fresh: list[SimSeq] = []
        starts = self._starts
        while starts and starts[0][0] <= s1:
            entry = starts.popleft()
            if _stale(entry, running):
                continue
            seq = running[entry[1]]
            produced += min(s1, seq.last) - seq.first + 1
            self._live += 1
            if seq.done == 0:
                fresh.append(seq)
        done: list[RequestOutput] = []
        heap = self._finishes
        while heap and heap[0][0] <= s1:
            entry = heapq.heappop(heap)
            if _stale(entry, running):
                continue
            seq = running.pop(entry[1])
            if seq.first <= s0:
                produced -= s1 - seq.last
            self._live -= 1
            seq.epoch += 1
            seq.status, seq.finish_reason, seq.num_tokens = "finished", seq.reason, seq.length
            request = seq.request
            request.num_unfinished -= 1
            if request.num_unfinished == 0:
                self.requests.pop(request.request_id, None)
                done.append(self.completions.output(request))
                request.seqs = []
        self._step = s1
        if not running:  # whatever is left in the indexes is stale
            self._finishes.clear()
            self._starts.clear()
        return produced, fresh, done

    def _stamp(
        self,
        start: float,
        end: float,
        step_s: float,
        fresh: list[SimSeq],
        done: list[RequestOutput],
    ) -> None:
        """Times of the call's events (wall clock): a first token at its virtual step counted
        back from the call's end (``step_s`` apart, not before its start); finishes at the end."""
        for seq in fresh:
            metrics = seq.request.metrics
            at = max(start, end - (self._step - seq.first) * step_s)
            if metrics.first_token_time is None:
                metrics.first_token_time = at
            if seq.index == 0 and self.metrics is not None:
                self.metrics.time_to_first_token_s.observe(at - metrics.arrival_time)
        for output in done:
            output.metrics.finished_time = end
        if self.metrics is not None:
            self.metrics.last_sample_time = end

    def _run(self, seq: SimSeq) -> int:
        """``seq`` was admitted before the next step: schedule its run; returns the tokens its
        prefill computes (the prompt, and the output so far for a resumed sequence)."""
        request = seq.request
        if not request.admitted:
            request.admitted = True
            self._total_prompt_tokens += len(request.prompt_token_ids)
        seq.first = self._step + self._ttft_steps
        seq.last = seq.first + seq.length - seq.done - 1
        heapq.heappush(self._finishes, (seq.last, seq.seq_id, seq.epoch))
        self._starts.append((seq.first, seq.seq_id, seq.epoch))
        self._compact()
        return len(request.prompt_token_ids) + seq.done

    def _leave(self, seq: SimSeq) -> int:
        """``seq`` stops running or waiting now (abort, suspension, preemption); returns the
        tokens it has produced."""
        if seq.status == "waiting":
            self.scheduler.waiting.remove(seq)
            return seq.done
        if seq.status != "running":
            return seq.done
        del self.scheduler.running[seq.seq_id]
        seq.epoch += 1
        if seq.first <= self._step:
            self._live -= 1
        return seq.done + max(0, min(self._step, seq.last) - seq.first + 1)

    def _compact(self) -> None:
        """Drop stale index entries once they outnumber the running sequences (entries of a
        sequence that left early stay until their step comes or they are swept here)."""
        running = self.scheduler.running
        if len(self._finishes) > 2 * len(running) + 64:
            self._finishes = [e for e in self._finishes if not _stale(e, running)]
            heapq.heapify(self._finishes)
        if len(self._starts) > 2 * len(running) + 64:
            self._starts = deque(e for e in self._starts if not _stale(e, running))

    def _observe(
        self, step_s: float, k: int, tokens: int, decodes: int, finished: list[RequestOutput]
    ) -> None:
        metrics = self.metrics
        assert metrics is not None
        metrics.step_time_s.observe(step_s, k)
        metrics.tokens_per_step.observe(tokens / k, k)
        if decodes > 0:
            metrics.inter_token_latency_s.observe(step_s, decodes)
        for output in finished:
            first = output.outputs[0]
            if first.index != 0:
                continue  # a completion of a split request counts as no request
            end = output.metrics.finished_time or time.time()
            metrics.e2e_request_latency_s.observe(end - output.metrics.arrival_time)
            reason = first.finish_reason or "unknown"
            metrics.finished[reason] = metrics.finished.get(reason, 0) + 1

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self._stats
        sched = self.scheduler
        bs = self.config.block_size
        step = self._step
        used = 0
        for seq in sched.running.values():
            tokens = seq.done + max(0, min(step, seq.last) - seq.first + 1)
            used += -(-(len(seq.request.prompt_token_ids) + tokens) // bs)
        s.num_running = len(sched.running)
        s.num_waiting = len(sched.waiting)
        s.kv_blocks_used = used
        s.kv_blocks_free = max(0, s.kv_blocks_total - used)
        s.num_preemptions = sched.num_preemptions
        s.total_prompt_tokens = self._total_prompt_tokens
        return EngineStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})


def _stale(entry: tuple[int, int, int], running: dict[int, SimSeq]) -> bool:
    seq = running.get(entry[1])
    return seq is None or seq.epoch != entry[2]
