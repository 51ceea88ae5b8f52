"""The engine: add requests, call ``step()`` until none are left.

``step()`` is schedule -> run the model -> postprocess (sample, detokenize, check stops, free
finished sequences); it returns the requests that finished during the step. A prompt that
fills ``max_model_len`` is rejected; ``prompt + max_tokens`` beyond it is clamped ("length");
``abort_request`` frees KV at once and the next ``step()`` reports "abort"; ``n > 1`` forks
after the prompt. The rules in full: docs/engine.md ("The step loop").
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.detokenize import detokenize_step, start_detokenizer
from engine.core.model_runner import ModelRunner, resolve_device
from engine.core.outputs import (
    CompletionOutput,
    EngineStats,
    RequestError,
    RequestMetrics,
    RequestOutput,
)
from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams, check_new_request, check_resume
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Sequence, Status
from engine.core.stats import EngineMetrics
from engine.core.step_cost import StepCostCurve
from engine.cpu.kernels import layer_ops
from engine.text.structured import GrammarBackend
from engine.text.tokenizer import find_stop, load_tokenizer
from engine.threads.governor import CpuThreads

log = logging.getLogger("engine")


class Engine:
    def __init__(self, model: str, **config: Any) -> None:
        given = EngineConfig.from_kwargs(**config)
        self.config = given.for_device(resolve_device(given.device).type)
        self.runner = ModelRunner(str(model), self.config)
        self.model_config = self.runner.model_config
        self.tokenizer = load_tokenizer(str(model))
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.block_manager, self.runner.loras)
        self.eos_token_ids = _eos_ids(self.tokenizer, self.runner.model)
        ops = layer_ops() if self.runner.device.type == "cpu" and self.config.cpu_kernels else None
        self.sampler = Sampler(
            self.config.seed,
            self.runner.device,
            self.eos_token_ids,
            argmax=ops.argmax if ops is not None else None,
        )
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._stats = EngineStats(kv_blocks_total=self.runner.num_blocks)
        self._grammar: GrammarBackend | None = None  # built by the first structured request
        self.metrics = EngineMetrics() if self.config.enable_metrics else None
        # the host's urgent guard reads it
        self.step_cost = StepCostCurve(self.config.resolved_max_num_seqs)
        self.cpu_threads = (
            CpuThreads(torch.get_num_threads())
            if self.config.adapt_cpu_threads and self.runner.device.type == "cpu"
            else None
        )
        log.info(
            "engine ready: %d KV blocks, max_model_len %d",
            self.runner.num_blocks,
            self.max_model_len,
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
        lora: str | None = None,
    ) -> None:
        """Queue a request. ``priority``: lower is admitted first (vLLM's convention); requests
        already running are never preempted for it. ``cache_salt`` (vLLM's name): the request
        reuses cached prompt blocks only of requests with the same salt; a multi-tenant caller
        passes the tenant, so no tenant can see (or time) another's cached prompts.

        ``completion_index``: the request is completion ``completion_index`` of an ``n > 1``
        request that its caller split into single completions (``params.n`` 1), each of which
        it can schedule and suspend on its own: it samples with ``seed + completion_index``
        (the completion an unsplit request gives that index), its output's one completion
        carries that index, and only completion 0 counts the prompt, its cache hit and the
        request in the engine's statistics, as an unsplit request counts once. Completions
        admitted together read the prompt's blocks from the prefix cache after the first
        computes them.

        ``lora``: the name of a registered LoRA adapter its rows apply (None: the base model);
        an unknown name raises :class:`engine.lora.AdapterError`. Its prefix-cache blocks are
        shared only with requests of the same adapter."""
        if lora is not None:
            self.runner.loras.check(lora)
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
        max_len = min(len(prompt) + params.max_tokens, self.max_model_len)
        bm = self.block_manager
        if bm.blocks_needed(max_len) > bm.num_blocks:
            raise RequestError(
                f"request {request_id!r} needs up to {max_len} tokens ({bm.blocks_needed(max_len)} KV "
                f"blocks) but the KV cache holds {bm.num_blocks} blocks of {bm.block_size} tokens",
                "kv_cache_too_small",
            )
        request = Request(
            request_id,
            prompt,
            params,
            RequestMetrics(arrival_time=time.time()),
            cache_salt=cache_salt,
            lora=lora,
        )
        request.admitted = completion_index > 0  # counted by completion 0 (_count_prompt)
        seq = Sequence(
            request,
            completion_index,
            list(prompt),
            max_len,
            self._generator(params, completion_index),
        )
        if params.structured:
            try:
                seq.matcher = self.grammar.matcher(params)
            except ValueError as exc:
                code = "invalid_json_schema" if params.json_schema is not None else "invalid_regex"
                raise RequestError(f"request {request_id!r}: {exc}", code) from exc
        seq.expected_work = max_len * params.n
        seq.priority = int(priority)
        start_detokenizer(seq)
        request.seqs.append(seq)
        request.num_unfinished = 1
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def add_lora(self, name: str, path: str) -> None:
        """Register the LoRA adapter peft saved in ``path`` under ``name``, checked against the
        model (:class:`engine.lora.AdapterError` if it does not fit); requests name it from now
        on. It is loaded when a request that uses it is admitted."""
        self.runner.loras.register(name, path)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; the next ``step()`` reports it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                self._final_text(seq)
        request.metrics.finished_time = time.time()
        self._aborted.append(self._output(request))
        request.seqs = []  # see _postprocess
        return True

    def suspend_request(self, request_id: str) -> Request | None:
        """Take an unfinished single-completion request out of the engine without losing what
        it has generated: its KV blocks are freed now (full ones stay in the prefix cache) and
        it is no longer scheduled. :meth:`resume_request` puts it back; it then recomputes its
        tokens, mostly from the cache, and goes on where it stopped, with the same output a
        run without the pause gives. None (nothing done) for an unknown, finished or
        ``n > 1`` request. A caller uses this to give a request's room to other work."""
        request = self.requests.get(request_id)
        if request is None or len(request.seqs) != 1 or request.params.n != 1:
            return None
        seq = request.seqs[0]
        if seq.status is Status.FINISHED:
            return None
        self.scheduler.suspend(seq)
        del self.requests[request_id]
        self._stats.num_suspended += 1
        return request

    def resume_request(self, request: Request) -> None:
        """Put back a request that :meth:`suspend_request` took out."""
        (seq,) = request.seqs
        check_resume(request.request_id, self.requests, seq.status is Status.SUSPENDED)
        self.requests[request.request_id] = request
        self.scheduler.resume(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        finished, self._aborted = self._aborted, []
        if self.cpu_threads is not None:
            self.cpu_threads.poll()
        scheduled = self.scheduler.schedule()
        num_tokens = 0
        if scheduled:
            batch = self.runner.prepare(scheduled)
            num_tokens = batch.num_tokens
            masks = self._grammar.start(batch.sample_seqs) if self._grammar else None
            t0 = time.perf_counter()
            logits = self.runner.forward(batch)
            self._stats.total_forward_time_s += time.perf_counter() - t0
            if masks is not None:
                logits = self._grammar.apply(logits, masks)  # type: ignore[union-attr]
            finished.extend(self._postprocess(scheduled, batch.sample_seqs, logits))
        s = self._stats
        s.num_steps += 1
        s.last_step_tokens = num_tokens
        s.total_scheduled_tokens += num_tokens
        s.total_running_seq_steps += len(scheduled)
        elapsed = time.perf_counter() - start
        s.total_step_time_s += elapsed
        if scheduled:
            self.step_cost.observe(len(scheduled), num_tokens, elapsed)
        if self.metrics is not None:
            self.metrics.on_step(elapsed, num_tokens)
        return finished

    def _postprocess(
        self,
        scheduled: list[tuple[Sequence, int]],
        sample_seqs: list[Sequence],
        logits: torch.Tensor,
    ) -> list[RequestOutput]:
        bm = self.block_manager
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            bm.mark_computed(seq)
        seqs = list(sample_seqs)
        rows = None
        for i, seq in enumerate(sample_seqs):
            if seq.needs_fork:
                seq.needs_fork = False
                rows = rows if rows is not None else list(range(len(sample_seqs)))
                deferred = []
                for j in range(1, seq.params.n):
                    if len(self.scheduler.running) < self.scheduler.max_num_seqs:
                        seqs.append(self._fork(seq, j))
                        rows.append(i)
                    else:
                        deferred.append(self._defer_fork(seq, j))
                for child in reversed(deferred):  # first in line, in index order
                    self.scheduler.waiting.push_front(child)
        if rows is not None:
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = self.sampler(logits, seqs)
        now = time.time()
        done: list[RequestOutput] = []
        eos = self.eos_token_ids
        for k, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            seq.token_ids.append(token)
            if logprobs is not None and seq.logprobs is not None:
                entry = logprobs[k]
                assert entry is not None  # the sampler makes one for each sequence that asks
                seq.logprobs.append(entry)
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            params = seq.params
            reason: str | None = None
            stop: str | int | None = None
            # a structured output's value is complete: its grammar allows nothing more
            closed = seq.matcher is not None and self._grammar.advance(seq, token)  # type: ignore[union-attr]
            # below min_tokens nothing stops the completion (the sampler masks the stop ids)
            early = seq.num_output_tokens < params.min_tokens
            if closed or (not early and not params.ignore_eos and token in eos):
                reason = "stop"
            elif not early and params.stop_token_ids and token in params.stop_token_ids:
                reason, stop = "stop", token
            elif params.stop:
                assert not isinstance(params.stop, str)  # SamplingParams made it a list
                delta = detokenize_step(self.tokenizer, seq)
                if delta and not early:
                    hit = find_stop(seq.text, len(delta), params.stop)
                    if hit is not None:
                        seq.text = seq.text[: hit[0]]
                        reason, stop = "stop", hit[1]
            if reason is None and len(seq) >= seq.max_len:
                reason = "length"
            if reason is not None:
                seq.finish_reason, seq.stop_reason = reason, stop
                if not (reason == "stop" and isinstance(stop, str)):
                    self._final_text(seq)
                self.scheduler.finish(seq)
                request.num_unfinished -= 1
                if request.num_unfinished == 0:
                    request.metrics.finished_time = now
                    self.requests.pop(request.request_id, None)
                    done.append(self._output(request))
                    # A request and its sequences refer to each other: break the cycle, so
                    # they (and a grammar matcher's native state) are freed now, not at the
                    # next full collection.
                    request.seqs = []
        self._stats.total_output_tokens += len(seqs)
        if self.metrics is not None:
            # A completion of a split request (completion_index > 0) counts as no request.
            counted = [out for out in done if out.outputs[0].index == 0]
            self.metrics.on_sample(now, seqs, counted)
        return done

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """Completion ``index`` of an ``n > 1`` request: shares the parent's full prompt blocks."""
        child = self._child(parent, index, list(parent.token_ids))
        full = parent.num_computed_tokens // self.config.block_size
        shared = parent.block_table[:full]
        self.block_manager.share(shared)
        child.block_table = list(shared)
        child.num_computed_tokens = full * self.config.block_size
        child.block_hashes = parent.block_hashes[:full]
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        self.scheduler.add_running(child)
        return child

    def _defer_fork(self, parent: Sequence, index: int) -> Sequence:
        """Completion ``index`` of an ``n > 1`` request when the running set is full: it waits,
        first in line, as a sequence of the prompt alone; admitted, it reads the prompt's
        blocks from the prefix cache and samples its first token from its own logits."""
        child = self._child(parent, index, list(parent.request.prompt_token_ids))
        child.expected_work = parent.max_len
        return child

    def _child(self, parent: Sequence, index: int, token_ids: list[int]) -> Sequence:
        """Completion ``index`` of ``parent``'s request, counted in it, with the parent's
        admission keys and a copy of its grammar state (no token sampled yet)."""
        request = parent.request
        child = Sequence(
            request, index, token_ids, parent.max_len, self._generator(parent.params, index)
        )
        child.bucket = parent.bucket
        child.priority = parent.priority
        child.matcher = parent.matcher.deep_copy() if parent.matcher is not None else None
        start_detokenizer(child)
        request.seqs.append(child)
        request.num_unfinished += 1
        return child

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.temperature == 0.0:
            return None
        gen = torch.Generator(device=self.runner.device)
        gen.manual_seed(params.seed + index)
        return gen

    def _final_text(self, seq: Sequence) -> None:
        out = seq.output_token_ids
        stopped = seq.finish_reason == "stop" and out
        if stopped and (
            isinstance(seq.stop_reason, int)
            or (seq.stop_reason is None and out[-1] in self.eos_token_ids)
        ):
            # the stop token or end-of-sequence is not part of the text (special tokens kept
            # or not)
            out = out[:-1]
        seq.text = self.tokenizer.decode(out, skip_special_tokens=seq.params.skip_special_tokens)

    def _output(self, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,  # type: ignore[arg-type]
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
            )
            for seq in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=request.metrics,
        )

    @property
    def grammar(self) -> GrammarBackend:
        """The grammar backend, built on first use (it wraps the tokenizer for llguidance)."""
        if self._grammar is None:
            eos = min(self.eos_token_ids) if self.eos_token_ids else None
            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size, eos)
        return self._grammar

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self._stats
        sched, bm = self.scheduler, self.block_manager
        s.num_running = len(sched.running)
        s.num_waiting = len(sched.waiting)
        s.kv_blocks_used = bm.num_used_blocks
        s.kv_blocks_free = bm.num_free_blocks
        s.num_preemptions = sched.num_preemptions
        s.num_chunked_prefills = sched.num_chunked_prefills
        if self._grammar is not None:
            g = self._grammar
            s.num_grammar_masks = g.num_masks
            s.total_grammar_mask_time_s = g.mask_time_s
            s.total_grammar_wait_time_s = g.wait_time_s
        for key, value in self.runner.loras.stats().items():
            setattr(s, key, value)
        s.total_prompt_tokens = sched.total_prompt_tokens
        s.total_cached_tokens = sched.total_cached_tokens
        s.prefix_cache_hit_rate = (
            sched.total_cached_tokens / sched.total_prompt_tokens
            if sched.total_prompt_tokens
            else 0.0
        )
        return EngineStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})


def _eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(e) for e in eos)
    return frozenset(ids)
