"""The engine as a system of the benchmark: one timed run over a workload, its counters and
where its time went."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, is_dataclass
from typing import Any

from benchmarks.systems import SystemResult
from cli.perf.workload import Workload


def _stats_dict(stats: Any) -> dict[str, Any]:
    return asdict(stats) if is_dataclass(stats) else dict(vars(stats))


def _engine_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Means over the timed run only (the engine's counters also hold the warm-up)."""

    def delta(name: str) -> float:
        return float(after.get(name, 0) or 0) - float(before.get(name, 0) or 0)

    steps = delta("num_steps")
    step_time = delta("total_step_time_s")
    prompt = delta("total_prompt_tokens")
    return {
        "num_steps": int(steps),
        "mean_running_seqs": delta("total_running_seq_steps") / steps if steps else 0.0,
        "mean_tokens_per_step": delta("total_scheduled_tokens") / steps if steps else 0.0,
        "num_preemptions": int(delta("num_preemptions")),
        "prefix_cache_hit_rate": delta("total_cached_tokens") / prompt if prompt else 0.0,
        "total_step_time_s": step_time,
        "mean_step_ms": 1000 * step_time / steps if steps else 0.0,
        "total_forward_time_s": delta("total_forward_time_s"),
        "outside_forward_frac": 1.0 - delta("total_forward_time_s") / step_time
        if step_time
        else 0.0,
        "kv_blocks_total": after.get("kv_blocks_total"),
        "grammar_masks": int(delta("num_grammar_masks")),
        "grammar_mask_ms_per_step": 1000 * delta("total_grammar_mask_time_s") / steps
        if steps
        else 0.0,
        "grammar_wait_ms_per_step": 1000 * delta("total_grammar_wait_time_s") / steps
        if steps
        else 0.0,
    }


# The schema a structured share of the requests must follow: a classification record with an
# enum, a bounded number, a nested object and a bounded array (a typical batch extraction).
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "entity": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["label", "score", "entity", "tags"],
    "additionalProperties": False,
}


def run_engine(
    model_dir: str,
    workload: Workload,
    engine_config: dict[str, Any],
    label: str = "engine",
    structured_share: float = 0.0,
) -> SystemResult:
    """The engine on ``workload``; ``structured_share`` of the requests (spread evenly) are
    constrained by :data:`BENCH_SCHEMA` and end when their JSON closes."""
    from benchmarks import phases
    from engine import Engine, SamplingParams

    engine = Engine(model_dir, **engine_config)
    trace = phases.StepTrace(sync=phases.device_sync(engine.runner.device))
    phases.trace_engine(engine, trace)
    metrics_cpu = _time_metrics(engine)

    def params(n: int, i: int = 0) -> SamplingParams:
        constrained = int((i + 1) * structured_share) > int(i * structured_share)
        schema = BENCH_SCHEMA if constrained else None
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, json_schema=schema)

    def drain(expected: int) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
                done[out.request_id] = list(out.outputs[0].token_ids)
        if len(done) != expected:
            raise RuntimeError(f"engine finished {len(done)} of {expected} requests")
        return done

    rng = random.Random(1234)
    vocab_hi = max(4, len(engine.tokenizer) - 8)
    for i in range(2):  # warm-up
        engine.add_request(f"warmup-{i}", [rng.randrange(3, vocab_hi) for _ in range(8)], params(4))
    drain(2)

    before = _stats_dict(engine.stats())
    trace.start()
    metrics_cpu[0] = 0.0
    cpu0, start = time.process_time(), time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
        engine.add_request(f"req-{i}", prompt, params(n, i))
    done = drain(len(workload.prompts))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    trace.close()
    after = _stats_dict(engine.stats())

    token_ids = [done[f"req-{i}"] for i in range(len(workload.prompts))]
    generated = sum(len(t) for t in token_ids)
    profile = phases.summarise(trace.steps, engine.config.max_num_seqs)
    extra = {
        "engine_stats": _engine_figures(before, after),
        "engine_config": _stats_dict(engine.config),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "phases": profile,
        "metrics_cpu_s": metrics_cpu[0] if engine.metrics is not None else None,
    }
    if engine.runner.device.type == "cpu":
        from benchmarks import matmul_share

        cfg = engine.runner.model_config
        rate = matmul_share.matmul_rate(
            engine.runner.dtype, 2048, cfg.hidden_size, cfg.intermediate_size
        )
        layers, head = matmul_share.model_weights(engine.runner)
        extra["matmul"] = {
            "rate_gflop_per_cpu_s": rate / 1e9,
            "shape": [2048, cfg.hidden_size, cfg.intermediate_size],
            "phases": matmul_share.shares(profile, layers, head, rate),
        }
    return SystemResult(
        label, wall, workload.prompt_tokens, generated, generated, cpu, token_ids, extra
    )


class _TimedMetrics:
    """The engine's metrics with the CPU time of its two hooks counted in ``spent[0]``."""

    def __init__(self, inner: Any, spent: list[float]) -> None:
        self._inner, self._spent = inner, spent

    def _timed(self, hook: Any, *args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return hook(*args)
        finally:
            self._spent[0] += time.thread_time() - t0

    def on_step(self, *args: Any) -> Any:
        return self._timed(self._inner.on_step, *args)

    def on_sample(self, *args: Any) -> Any:
        return self._timed(self._inner.on_sample, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _time_metrics(engine: Any) -> list[float]:
    """Count the CPU time of the stepping thread inside the engine's metrics hooks
    (``EngineMetrics.on_step`` / ``on_sample``): the direct cost of recording them."""
    spent = [0.0]
    if engine.metrics is not None:
        engine.metrics = _TimedMetrics(engine.metrics, spent)
    return spent


def engine_device_dtype(engine_config: dict[str, Any]) -> tuple[str, str]:
    """The device and dtype the engine resolves ``engine_config`` to: every system runs there."""
    from engine.core.config import EngineConfig
    from engine.core.model_runner import resolve_device, resolve_dtype

    cfg = EngineConfig.from_kwargs(**engine_config)
    device = resolve_device(cfg.device)
    return str(device), str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical in both systems."""
    if not a or len(a) != len(b):
        return 0.0
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
