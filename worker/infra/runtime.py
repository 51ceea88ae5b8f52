"""Per-process model state: tokenizers for the control worker, one engine host per served model
for the model workers (a dispatcher, :mod:`worker.upstream.dispatcher`, for an upstream model).

Everything the worker knows about the engine lives here. Engines load once per process, under
a lock, on first use or at worker start; the threads pool then shares them, so there is never
a fork after a model is loaded. The engine and torch are imported only when a model loads, and
so is the dispatcher: ``worker.infra`` is the room the others stand on, and imports none of
them at module level (``tests/test_structure.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery.worker.control import inspect_command

from core.llms import specs
from core.llms.demo import build
from core.llms.gguf import ModelSourceError
from core.observability import metrics
from core.settings import get_settings
from engine.sim.simulator import DEFAULT_MAX_MODEL_LEN, SimEngine
from worker.host_contract import Host

if TYPE_CHECKING:
    from engine.embedding.embedding_host import EmbeddingHost

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_tokenizers: dict[str, Any] = {}
_context: dict[str, int] = {}
_hosts: dict[str, Host] = {}
_load_locks: dict[str, threading.Lock] = {}
# One model loads at a time in a process: transformers' loading is not thread-safe (its
# meta-device initialisation is process-global), and two at once corrupt each other.
_loading = threading.Lock()
_refused: dict[str, str] = {}  # served model -> why its files cannot be served
_refused_adapters: dict[str, str] = {}  # adapter -> why its base's engine runs it not

# Options in ``engine_options`` that size the host rather than the engine.
HOST_OPTIONS = ("max_pending", "engine_backlog", "group_window", "lead_requests", "lead_steps")


class IsolationGate:
    """Lets one shard at a time run requests alone on a host (see ``worker.shards.run.ShardRun``):
    while it is held, the other shards of the process hold back their submissions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: object | None = None

    def try_acquire(self, owner: object) -> bool:
        with self._lock:
            if self._owner is None:
                self._owner = owner
            return self._owner is owner

    def release(self, owner: object) -> None:
        with self._lock:
            if self._owner is owner:
                self._owner = None

    def held_by_other(self, owner: object) -> bool:
        current = self._owner
        return current is not None and current is not owner


_gates: weakref.WeakKeyDictionary[Host, IsolationGate] = weakref.WeakKeyDictionary()


def isolation_gate(engine_host: Host) -> IsolationGate:
    """The isolation gate of ``engine_host`` (one per host, created on first use)."""
    with _lock:
        gate = _gates.get(engine_host)
        if gate is None:
            gate = _gates[engine_host] = IsolationGate()
        return gate


def engine_model(model: str) -> str:
    """The served model whose engine runs ``model``'s lines: a LoRA adapter's base (its
    tokenizer, context and queue too), else ``model`` itself."""
    return specs.engine_models(get_settings().models).get(model, model)


def adapter_refusal(adapter: str) -> str | None:
    """Why this process's engine of the adapter's base does not run ``adapter`` (its directory
    was missing or refused when the engine loaded), or None."""
    with _lock:
        return _refused_adapters.get(adapter)


def model_spec(model: str) -> str:
    spec = get_settings().models.get(model)
    if spec is None:
        raise KeyError(f"model {model!r} is not served here")
    return spec


def is_upstream(model: str) -> bool:
    """Whether ``model`` is served by an upstream server (its lines go there as written)."""
    return specs.is_upstream(get_settings().models.get(engine_model(model), ""))


def model_dir(model: str) -> Path:
    """The local directory of served model ``model`` (demo presets are built and GGUF files
    converted on first use). A model whose files cannot be served (a missing file, not GGUF,
    an architecture transformers cannot read, a corrupt file) is refused: ``ModelSourceError``
    naming the model and the file, now and at every later call in this process."""
    with _lock:
        refused = _refused.get(model)
    if refused is not None:
        raise ModelSourceError(refused)
    spec = model_spec(model)
    try:
        source = specs.source_spec(spec)  # a simulated model's: its tokenizer's
        path = specs.spec_dir(source)
    except ValueError as exc:
        if not isinstance(exc, ModelSourceError) and not specs.is_sim(spec):
            raise
        message = f"model {model!r} ({spec}) is refused: {exc}"
        with _lock:
            _refused[model] = message
        logger.error("%s", message)
        raise ModelSourceError(message) from exc
    if path is None:
        return build(source.split(":", 1)[1])
    return path


def tokenizer(model: str) -> Any:
    """The model's tokenizer; the engine's own when this process runs the model. An upstream
    model has the tokenizer its spec names, or none (None: its prompts are counted by their
    size, :func:`core.llms.generation.approx_prompt_tokens`). An adapter's is its base's."""
    model = engine_model(model)
    spec = model_spec(model)
    if specs.is_upstream(spec):
        source = specs.upstream_spec(spec, model).tokenizer
        return None if source is None else _spec_tokenizer(model, source)
    with _lock:
        host = _hosts.get(model)
        if host is not None:
            return host.tokenizer
        tok = _tokenizers.get(model)
        if tok is not None:
            return tok
    return _spec_tokenizer(model, None)


def _spec_tokenizer(model: str, source: str | None) -> Any:
    """The tokenizer of ``model`` loaded from its files, or from those of the spec ``source``."""
    with _lock:
        tok = _tokenizers.get(model)
    if tok is not None:
        return tok
    # torch: imported only where a tokenizer is loaded
    from engine.text.tokenizer import load_tokenizer

    # outside the lock: a GGUF file's first conversion takes a while
    if source is None:
        path = model_dir(model)
    else:
        found = specs.spec_dir(source)
        path = found if found is not None else build(source.split(":", 1)[1])
    tok = load_tokenizer(str(path))
    with _lock:
        return _tokenizers.setdefault(model, tok)


def context_length(model: str) -> int:
    """The most tokens (prompt + output) one sequence of ``model`` may hold."""
    model = engine_model(model)
    with _lock:
        if model in _context:
            return _context[model]
    limit = get_settings().engine_options.get("max_model_len")
    spec = model_spec(model)
    if specs.is_upstream(spec):
        limit = specs.upstream_spec(spec, model).max_model_len
    elif specs.is_sim(spec):
        model_dir(model)  # a bad spec is refused here as at load
        limit = specs.sim_spec(spec).max_model_len or limit or DEFAULT_MAX_MODEL_LEN
    if limit is None:
        from transformers import AutoConfig  # seconds to import: only for a local model

        config = AutoConfig.from_pretrained(model_dir(model))
        limit = getattr(config, "max_position_embeddings", None) or 2048
    with _lock:
        _context[model] = int(limit)
    return int(limit)


def host(model: str) -> Host:
    """The process-wide engine host for ``model``, loaded and started on first use (an
    adapter's: its base's, which runs it)."""
    model = engine_model(model)
    with _lock:
        existing = _hosts.get(model)
        if existing is not None:
            return existing
        load_lock = _load_locks.setdefault(model, threading.Lock())
    with load_lock:  # one loader per model; other models and tokenizers stay available
        with _lock:
            existing = _hosts.get(model)
        if existing is not None:
            return existing
        spec = model_spec(model)
        if specs.is_upstream(spec):
            return _start_dispatcher(model, spec)
        with _loading:
            return _load_host(model, spec)


def _load_host(model: str, spec: str) -> Host:
    """Load ``model``'s engine (or embedding engine) and start its host (under ``_loading``)."""
    # torch: imported only by a process that runs a model
    from engine import EngineHost

    settings = get_settings()
    options = dict(settings.engine_options)
    host_options = {k: options.pop(k) for k in HOST_OPTIONS if k in options}
    started_at = time.monotonic()
    path = model_dir(model)
    logger.info("loading model %s from %s", model, path)
    if specs.kind_of(spec) == "embedding":
        return _start_embedding_host(model, path, options, started_at)
    options.setdefault("enable_metrics", settings.metrics_enabled)
    if specs.is_sim(spec):
        return _start_sim_host(model, spec, path, options, host_options, started_at)
    options.setdefault("adapt_cpu_threads", settings.adapt_cpu_threads)
    engine = _load_engine(model, path, options)
    host = EngineHost(engine, name=f"engine-host-{model}", **_host_policy(host_options))
    started = host.start()
    configured = getattr(getattr(engine, "config", None), "max_model_len", None)
    with _lock:
        _hosts[model] = started
        if configured:
            _context[model] = int(configured)
    metrics.ENGINE_LOADS.labels(model=model).inc()
    runner = getattr(engine, "runner", None)
    logger.info(
        "model %s ready: %s on %s, loaded in %.1f s",
        model,
        str(getattr(runner, "dtype", "?")).removeprefix("torch."),
        getattr(runner, "device", "?"),
        time.monotonic() - started_at,
    )
    return started


def _load_engine(model: str, path: Path, options: dict[str, Any]) -> Any:
    """``model``'s engine with its LoRA adapters (``lora:`` entries). Adapters whose directory
    reads are given to the engine at load, so the memory their resident set may take comes off
    the KV budget; if the engine refuses one of them, the engine loads without them and
    :func:`_add_adapters` registers them one by one, leaving out (and naming) those refused."""
    # torch: this process runs the model
    from engine import Engine
    from engine.lora import AdapterError

    readable: dict[str, str] = {}
    for name, adapter in _adapters_of(model):
        assert adapter.path is not None
        try:
            specs.check_adapter_dir(adapter.path)
        except ValueError:
            continue  # named and left out by _add_adapters
        readable[name] = str(adapter.path)
    if readable:
        try:
            given = {**options, "lora_adapters": {**options.get("lora_adapters", {}), **readable}}
            engine = Engine(str(path), **given)
        except AdapterError as exc:
            logger.warning("adapters of model %s loaded one by one: %s", model, exc)
        else:
            _add_adapters(model, engine, registered=set(readable))
            return engine
    engine = Engine(str(path), **options)
    _add_adapters(model, engine)
    return engine


def _adapters_of(model: str) -> list[tuple[str, specs.LoraSpec]]:
    """The ``lora:`` entries with a directory whose base is ``model``."""
    found = specs.adapters(get_settings().models).items()
    return [(n, a) for n, a in found if a.base == model and a.path is not None]


def _add_adapters(model: str, engine: Any, registered: Collection[str] = ()) -> None:
    """Register with ``engine`` the LoRA adapters whose base is ``model`` (but ``registered``,
    given at load). One whose directory is missing, no peft adapter directory, or one the engine
    refuses (a rank over ``max_lora_rank``, a layer the base does not have, ...) is left out,
    logged as an ERROR naming its entry: its lines get an error line each
    (:func:`adapter_refusal`), and the base and its other adapters run."""
    # torch: this process runs the model
    from engine.lora import AdapterError

    for name, adapter in _adapters_of(model):
        assert adapter.path is not None
        try:
            if name not in registered:
                specs.check_adapter_dir(adapter.path)
                engine.add_lora(name, str(adapter.path))
        except (ValueError, AdapterError) as exc:
            with _lock:
                _refused_adapters[name] = str(exc)
            logger.error("adapter %r of model %r is refused: %s", name, model, exc)
            continue
        logger.info("adapter %s ready on model %s (%s)", name, model, adapter.path)


def _start_dispatcher(model: str, spec: str) -> Host:
    """An upstream model's dispatcher: no weights, no torch; it starts at once."""
    # The upstream room stands above this one: imported only by a process that serves one.
    from worker.upstream.dispatcher import Dispatcher

    upstream = specs.upstream_spec(spec, model)
    started = Dispatcher(model, upstream, aging_s=get_settings().low_priority_aging_s).start()
    with _lock:
        _hosts[model] = started
        _context[model] = upstream.max_model_len
    logger.info("model %s ready: %s", model, upstream.describe())
    return started


def _host_policy(host_options: dict[str, Any]) -> dict[str, Any]:
    """The engine host's options: those given in ``engine_options``, the admission policy of
    the settings (tiers, aging, the lead of an idle engine) for the rest."""
    settings = get_settings()
    return {
        "reserved_share": settings.high_priority_reserved_share,
        "urgent_slowdown": settings.high_priority_max_slowdown,
        "aging_s": settings.low_priority_aging_s,
        "lead_requests": settings.first_results_lead,
        **host_options,
    }


def _start_sim_host(
    model: str,
    spec: str,
    path: Path,
    options: dict[str, Any],
    host_options: dict[str, Any],
    started_at: float,
) -> Host:
    """A simulated model's host (``engine.sim.simulator``): the engine options, with the spec's own
    options over them, and the host options every generation model gets."""
    from engine import EngineHost  # torch: only a process that runs a model gets here

    options.update(specs.sim_spec(spec).engine_kwargs())
    engine = SimEngine(str(path), **options)
    host = EngineHost(engine, name=f"engine-host-{model}", **_host_policy(host_options))  # type: ignore[arg-type]
    started = host.start()
    with _lock:
        _hosts[model] = started
        _context[model] = engine.max_model_len
    metrics.ENGINE_LOADS.labels(model=model).inc()
    logger.info(
        "model %s ready: simulated (%g tokens/s per sequence, max_num_seqs %d, ttft %g ms, "
        "max_model_len %d; tokenizer of %s), loaded in %.1f s",
        model,
        engine.tokens_per_s,
        engine.config.max_num_seqs,
        engine.ttft_ms,
        engine.max_model_len,
        specs.source_spec(spec),
        time.monotonic() - started_at,
    )
    return started


def _start_embedding_host(
    model: str, path: Path, options: dict[str, Any], started_at: float
) -> EmbeddingHost:
    """An embedding model's host: its device and dtype from the engine options; its batches
    sized by ``embedding_max_batch_tokens`` (default 16,384 padded tokens)."""
    # torch: imported only by a process that runs a model
    from engine.embedding.embedding_host import EmbeddingHost
    from engine.embedding.encoder import EmbeddingEngine

    engine = EmbeddingEngine(
        path,
        device=options.get("device", "auto"),
        dtype=options.get("dtype", "auto"),
        max_batch_tokens=int(options.get("embedding_max_batch_tokens", 16384)),
    )
    started = EmbeddingHost(engine, name=f"embedding-host-{model}").start()
    with _lock:
        _hosts[model] = started
        _context[model] = engine.max_model_len
    logger.info(
        "model %s ready (embeddings, %d dimensions): %s on %s, loaded in %.1f s",
        model,
        engine.dimension,
        str(engine.dtype).removeprefix("torch."),
        engine.device,
        time.monotonic() - started_at,
    )
    return started


def loaded_hosts() -> dict[str, Host]:
    with _lock:
        return dict(_hosts)


def shutdown_hosts() -> None:
    with _lock:
        hosts = list(_hosts.values())
        _hosts.clear()
    for h in hosts:
        h.shutdown(wait=True, abort_pending=True, timeout=30)


# --------------------------------------------------------------------------------------------
# Remote control: ``engine_stats``
#
# A Celery inspect command that answers with the stats of every engine host this process has
# loaded, as JSON-safe dicts keyed by served model name (``HostStats.as_dict()`` plus the
# engine's ``max_num_seqs``) and ``time`` (when the snapshot was taken, ``time.time()``),
# from a cache refreshed every 0.1 s while someone asks (see ``_StatsCache``). It is
# registered when this module is imported, which every worker process does (``worker.infra``
# imports it). Ask one worker:
#
#     celery -A worker.infra.celery inspect engine_stats -d model@host
#     app.control.broadcast("engine_stats", destination=["model@host"], reply=True, timeout=1)
#
# A worker without a loaded model answers ``{"models": {}}``.


def engine_stats_snapshot(timeout: float = 5.0) -> dict[str, dict[str, Any]]:
    """Each loaded host's stats (a host that cannot answer reports ``{"error": …}``)."""
    out: dict[str, dict[str, Any]] = {}
    for model, engine_host in loaded_hosts().items():
        snapshot = getattr(engine_host, "snapshot", None)
        if snapshot is not None:  # an upstream's dispatcher (as metrics.UpstreamCollector tells)
            out[model] = _json_safe(snapshot())
            continue
        # torch: the process that runs this host has imported it
        from engine.embedding.embedding_host import EmbeddingHost
        from engine.host.host import EngineHost

        if isinstance(engine_host, EmbeddingHost):  # its own few counters
            out[model] = {
                "kind": "embedding",
                "pending": engine_host.pending(),
                "completed": engine_host.completed,
                "failed": engine_host.failed,
                "aborted": engine_host.aborted,
            }
        elif isinstance(engine_host, EngineHost):
            try:
                stats = engine_host.stats(timeout=timeout).as_dict()
                stats["max_num_seqs"] = engine_host.engine.config.max_num_seqs
                stats["alive"] = engine_host.is_alive
                out[model] = _json_safe(stats)
            except Exception as exc:  # a dead loop or a stats timeout: say so, answer the rest
                out[model] = {"error": repr(exc)}
    return out


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    return repr(value)


class _StatsCache:
    """Answers ``engine_stats`` at once from snapshots a background thread takes every
    ``interval`` seconds: ``EngineHost.stats()`` waits for the end of the current engine step,
    and the command runs on the worker's consumer thread, which must never wait that long
    (it also receives tasks). The thread starts with the first command and stops once nobody
    has asked for ``idle_s`` seconds; the first answer after a start waits for one snapshot."""

    def __init__(self, interval: float = 0.1, idle_s: float = 60.0) -> None:
        self.interval = interval
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._latest: dict[str, Any] = {}
        self._asked = 0.0
        self._thread: threading.Thread | None = None

    def get(self, wait_s: float = 2.0) -> dict[str, Any]:
        with self._lock:
            self._asked = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._ready.clear()
                self._thread = threading.Thread(
                    target=self._run, name="batchd-engine-stats", daemon=True
                )
                self._thread.start()
        self._ready.wait(wait_s)
        with self._lock:
            return dict(self._latest)

    def _run(self) -> None:
        while time.monotonic() - self._asked < self.idle_s:
            models = engine_stats_snapshot()
            with self._lock:
                self._latest = {"time": time.time(), "models": models}
            self._ready.set()
            time.sleep(self.interval)


_stats_cache = _StatsCache()


@inspect_command(name="engine_stats")
def _engine_stats(state: Any, **_: Any) -> dict[str, Any]:
    snapshot = _stats_cache.get()
    return {"pid": os.getpid(), "time": snapshot.get("time"), **snapshot}
