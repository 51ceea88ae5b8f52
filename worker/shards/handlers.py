"""How each kind of request runs in a shard: a handler prepares a parsed request, submits it to
its host and reads what came back as a :data:`~worker.handler.RequestOutcome`.

:class:`GenerationHandler` runs chat, completions and responses on the engine host (a line
naming a LoRA adapter of the batch's model runs on the same engine with that adapter);
:class:`EmbeddingHandler` runs embeddings on the embedding host;
:class:`worker.upstream.handler.UpstreamHandler` sends every kind to an upstream server.
:class:`worker.shards.run.ShardRun` keeps what they share (checkpoints, cancel, retries,
suspects) and asks its handler the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from core.batches.priority import Priority
from core.batchfile.request import EMBEDDINGS_URL, BatchRequest
from core.batchfile.results import GenerationResult, embedding_body, output_line
from core.database.tables import Batch, Shard
from core.llms import generation, specs
from core.llms.generation import error_for_exception, error_record
from core.settings import get_settings
from engine import RequestError, SamplingParams
from worker.handler import (
    SUBMIT_WAIT_S,
    Aborted,
    EngineUnavailable,
    Failed,
    Handler,
    Line,
    Refused,
    RequestOutcome,
)
from worker.host_contract import Host
from worker.infra import REQUEST_ERRORS, runtime, storage
from worker.shards import timings
from worker.shards.prepared import read_prepared, tokenizer_fingerprint
from worker.upstream.handler import UpstreamHandler

if TYPE_CHECKING:
    from engine.embedding.embedding_host import EmbeddingHost
    from engine.host.host import EngineHost
    from worker.upstream.dispatcher import Dispatcher

logger = logging.getLogger(__name__)


def handler_for(shard: Shard, batch: Batch, host: Host) -> Handler:
    """The handler of the batch's requests. The model's spec and the batch's endpoint say
    which kind of host ``host`` is (``runtime.host`` started it from the same spec)."""
    spec = get_settings().models.get(batch.model or "", "")
    if specs.is_upstream(spec):
        upstream = specs.upstream_spec(spec, batch.model or "")
        # an adapter's lines name the adapter as the upstream serves it
        names = {n: a.forwarded_name for n, a in _adapters_of(batch.model or "").items()}
        return UpstreamHandler(batch, cast("Dispatcher", host), upstream, names)
    if batch.endpoint == EMBEDDINGS_URL:
        return EmbeddingHandler(batch, cast("EmbeddingHost", host))
    return GenerationHandler(shard, batch, cast("EngineHost", host))


def _adapters_of(model: str) -> dict[str, specs.LoraSpec]:
    """The LoRA adapters served on ``model``'s engine, by served name."""
    return {n: a for n, a in specs.adapters(get_settings().models).items() if a.base == model}


def adapter_error(req: BatchRequest, base: str, reason: str) -> dict[str, Any]:
    """The error line of a line whose adapter its base's engine cannot run."""
    return error_record(
        req.custom_id,
        "adapter_unavailable",
        f"The adapter {req.model!r} (body.model) cannot run on {base!r}: {reason}",
        param="body.model",
    )


class GenerationHandler:
    """Chat, completions and responses on the engine host. A line that names one of the
    model's LoRA adapters is submitted with it (``lora``); what it prepares is the prompt ids
    and ``(SamplingParams, adapter or None)``."""

    isolates_failures = True
    forwards_bodies = False

    def __init__(self, shard: Shard, batch: Batch, host: EngineHost):
        settings = get_settings()
        self.shard = shard
        self.batch_id = batch.id
        self.model = batch.model or ""
        self.adapters = _adapters_of(self.model)
        # why each adapter cannot run (None: it can), read once per shard
        self.adapter_problems: dict[str, str | None] = {}
        self.host = host
        # The engine admits lower values first: a "high" batch overtakes the nightly bulk.
        self.priority = Priority.parse(batch.priority).engine
        # Each tenant its own prefix cache (see Settings.share_prefix_cache_across_tenants).
        self.cache_salt = (
            None if settings.share_prefix_cache_across_tenants else f"tenant:{batch.tenant}"
        )
        self.tenant = batch.tenant  # the host shares each tier fairly across tenants
        # ... and runs a tenant's batches earliest deadline first.
        self.deadline = batch.expires_at.timestamp() if batch.expires_at is not None else None
        self.tok = host.tokenizer
        self.context = runtime.context_length(batch.model or "")
        self.vocab_size = len(self.tok)
        # The prompt ids validation stored for this shard (worker.shards.prepared), by input line.
        self.prepared = read_prepared(
            storage(), batch.id, shard.index, tokenizer_fingerprint(self.tok)
        )

    def prepare(
        self, req: BatchRequest
    ) -> tuple[list[int], tuple[SamplingParams, str | None]] | Line:
        lora = None
        if req.model != self.model:
            if req.model not in self.adapters:  # BATCHD_MODELS changed since validation
                reason = "it is not an adapter of this model in BATCHD_MODELS"
                return Line(adapter_error(req, self.model, reason))
            problem = self._adapter_problem(req.model)
            if problem is not None:
                return Line(adapter_error(req, self.model, problem))
            lora = req.model
        try:
            prompt, params = generation.prepare_request(
                self.tok,
                req,
                self.context,
                self.vocab_size,
                self.prepared.pop(req.line, None),
                make_params=SamplingParams,
            )
            return prompt, (params, lora)
        except REQUEST_ERRORS as exc:
            return Line(error_for_exception(req, exc))
        except Exception:
            logger.exception(
                "shard %s line %s: preparing the request failed", self.shard.id, req.line
            )
            raise

    def _adapter_problem(self, adapter: str) -> str | None:
        """Why ``adapter`` cannot run now: the engine refused it at load, or its directory
        has since gone or become unreadable (the engine reads its weights when a line makes it
        resident); None if it can."""
        if adapter not in self.adapter_problems:
            problem = runtime.adapter_refusal(adapter)
            path = self.adapters[adapter].path
            if problem is None and path is not None:
                try:
                    specs.check_adapter_dir(path)
                except ValueError as exc:
                    problem = str(exc)
            self.adapter_problems[adapter] = problem
        return self.adapter_problems[adapter]

    def submit(
        self,
        prompt: list[int],
        params: tuple[SamplingParams, str | None],
        done: Callable[[Future], None],
    ) -> None:
        # torch: imported only by a process that runs an engine host
        from engine.host.host import HostError

        try:
            self._submit(prompt, params, done)
        except HostError as exc:
            raise EngineUnavailable(str(exc)) from exc

    def _submit(
        self,
        prompt: list[int],
        params: tuple[SamplingParams, str | None],
        done: Callable[[Future], None],
    ) -> None:
        sampling, lora = params
        self.host.submit(
            prompt,
            sampling,
            group=self.batch_id,
            callback=done,
            timeout=SUBMIT_WAIT_S,
            priority=self.priority,
            cache_salt=self.cache_salt,
            tenant=self.tenant,
            deadline=self.deadline,
            lora=lora,
        )

    def outcome(self, req: BatchRequest, future: Future, submitted: float | None) -> RequestOutcome:
        # torch: imported only by a process that runs an engine host
        from engine.host.host import HostError
        from engine.lora import AdapterError

        exc = future.exception()
        if exc is not None:
            if isinstance(exc, HostError):
                raise EngineUnavailable(str(exc)) from exc
            if isinstance(exc, AdapterError):  # its directory unreadable, or incompatible
                return Line(adapter_error(req, self.model, str(exc)))
            if isinstance(exc, RequestError):
                return Refused(exc)
            if isinstance(exc, ValueError):  # a parameter the engine cannot honour
                return Line(error_for_exception(req, exc))
            # A failed engine step (or another engine failure): this request may be the
            # culprit or a bystander; only a run alone tells.
            return Failed(exc)
        output = future.result()
        if generation.is_aborted(output):
            return Aborted(generation.aborted_record(req))
        record, result = generation.finished_record(self.tok, req, output)
        if result is None:
            return Line(record)
        timings.record(self.batch_id, self.shard.index, req.custom_id, submitted, output)
        finished = getattr(getattr(output, "metrics", None), "finished_time", None)
        return Line(record, result, finished)

    def failed_line(self, req: BatchRequest, exc: BaseException, tries: int) -> dict[str, Any]:
        if req.model in self.adapters:  # its adapter's weights may have gone since prepare
            self.adapter_problems.pop(req.model, None)
            problem = self._adapter_problem(req.model)
            if problem is not None:
                return adapter_error(req, self.model, problem)
        cause = exc.__cause__ or exc
        logger.warning(
            "shard %s line %s failed the engine %s times alone: %r",
            self.shard.id,
            req.line,
            tries,
            cause,
        )
        return error_record(
            req.custom_id,
            "server_error",
            f"The engine failed on this request ({tries} attempts, the last ones run alone; "
            f"{type(cause).__name__}: the worker's log has the details)",
            status_code=500,
            type="server_error",
        )

    def drained(self, timeout: float) -> bool:
        # torch: imported only by a process that runs an engine host
        from engine.host.host import HostError

        try:
            stats = self.host.stats(timeout=timeout)
        except HostError as exc:
            raise EngineUnavailable(str(exc)) from exc
        return stats.pending + stats.in_flight == 0


class EmbeddingHandler:
    """Embeddings on the model's embedding host (``runtime.host``)."""

    isolates_failures = False
    forwards_bodies = False

    def __init__(self, batch: Batch, host: EmbeddingHost):
        self.batch_id = batch.id
        self.host = host

    def prepare(self, req: BatchRequest) -> tuple[list[list[int]], int] | Line:
        """The inputs as the model's token ids and the output size, or the request's error
        line (an input over the model's length, a token outside its vocabulary, a size it
        cannot cut to), naming the field."""
        # torch: imported only by a process that runs a model
        from engine.embedding.encoder import EmbeddingError

        engine = self.host.engine
        single = not isinstance(req.body.get("input"), list) or not isinstance(
            req.body["input"][0], str | list
        )
        try:
            dims = engine.check_dimensions(req.dimensions)
            inputs = [engine.token_ids(item, i) for i, item in enumerate(req.inputs or ())]
        except EmbeddingError as exc:
            param, message = f"body.{exc.param}", str(exc)
            if exc.param.startswith("input") and single:  # one input: no index to name
                param, message = "body.input", message.replace("input[0]", "input", 1)
            return Line(error_record(req.custom_id, exc.code, message, param=param))
        return inputs, dims

    def submit(self, prompt: list[list[int]], params: int, done: Callable[[Future], None]) -> None:
        self.host.submit(
            prompt, dimensions=params, group=self.batch_id, timeout=SUBMIT_WAIT_S
        ).add_done_callback(done)

    def outcome(self, req: BatchRequest, future: Future, submitted: float | None) -> RequestOutcome:
        # torch: imported only by a process that runs an engine host
        from engine.embedding.embedding_host import EmbeddingAborted, EmbeddingHostClosed

        exc = future.exception()
        if isinstance(exc, EmbeddingHostClosed):
            raise EngineUnavailable(str(exc)) from exc
        if isinstance(exc, EmbeddingAborted):  # a cancel, or something else: run it again
            return Aborted(generation.aborted_record(req))
        if exc is not None:  # its round failed
            return Failed(exc)
        outputs = future.result()
        tokens = sum(o.num_tokens for o in outputs)
        body = embedding_body(req, [o.embedding for o in outputs], tokens)
        usage = GenerationResult(prompt_tokens=tokens, cached_tokens=0, choices=[])
        return Line(output_line(req.custom_id, body), usage)

    def failed_line(self, req: BatchRequest, exc: BaseException, tries: int) -> dict[str, Any]:
        return error_for_exception(req, exc)

    def drained(self, timeout: float) -> bool:
        return self.host.pending() == 0  # not asked: its failures are not isolated
