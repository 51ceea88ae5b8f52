"""The LoRA oracle: a mixed batch (rows of several adapters, of different ranks and target
modules, and rows of the base model) runs through the engine together, and every line's greedy
output equals peft's ``merge_and_unload()`` of its adapter with ``generate()`` run one request
at a time (a base line: the plain model), token for token.

Under every regime the engine has: both forwards (the lean Llama one and transformers' own),
preemption, chunked prefill, prefix caching over prompts shared across adapters, and more
adapters than ``max_loras`` (eviction and reload). The demo Llama in float32 (conftest)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core.llms.demo import build
from engine import Engine, SamplingParams
from engine.core.model_runner import ModelRunner
from engine.lora import manager
from testkit.builders.lora import make_adapter

VOCAB = 2048
# name -> (rank, target modules, seed): ranks 2 to 16, attention only, MLP only, both.
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], 1),
    "all4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
    "mlp16": (16, ["gate_proj", "up_proj", "down_proj"], 3),
    "ko2": (2, ["k_proj", "o_proj"], 4),
    "qd12": (12, ["q_proj", "down_proj"], 5),
}
LINES = [None, *ADAPTERS]  # the lines of a batch cycle through the base and every adapter


@dataclass
class Case:
    prompt: list[int]
    max_tokens: int
    lora: str | None


def _cases(seed: int, count: int, shared_prefixes: bool) -> list[Case]:
    """With ``shared_prefixes``, every len(LINES) lines in a row are one prompt under the
    base and each adapter, and the prompts share one of two prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 70)]
    cases = []
    for i in range(count):
        if not shared_prefixes:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 5, 17, 33, 64, 90]))]
            cases.append(Case(prompt, rng.choice([1, 4, 9, 16]), LINES[i % len(LINES)]))
        elif i % len(LINES) == 0:
            prefix = prefixes[(i // len(LINES)) % len(prefixes)]
            prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
            max_tokens = rng.choice([4, 9, 16])
            cases.extend(Case(prompt, max_tokens, lora) for lora in LINES)
    return cases[:count]


def _reference(path: str, adapters: dict[str, Path], cases: list[Case]) -> list[list[int]]:
    """Greedy continuations by transformers, one request at a time, each adapter merged into
    its own copy of the model by peft; eos never stops them (the engine ignores it too)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out: dict[int, list[int]] = {}
    for lora in LINES:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, str(adapters[lora])).merge_and_unload()
        model.eval()
        config = copy.deepcopy(model.generation_config)
        config.eos_token_id = None
        with torch.inference_mode():
            for i, case in enumerate(cases):
                if case.lora != lora:
                    continue
                ids = torch.tensor([case.prompt])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=case.max_tokens,
                    do_sample=False,
                    generation_config=config,
                )
                out[i] = gen[0, len(case.prompt) :].tolist()
    return [out[i] for i in range(len(cases))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = str(build("llama-tiny"))
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_adapter(path, root / name, rank=rank, target_modules=targets, seed=seed)
        for name, (rank, targets, seed) in ADAPTERS.items()
    }
    plain = _cases(1, 36, shared_prefixes=False)
    shared = _cases(2, 36, shared_prefixes=True)
    return {
        "path": path,
        "adapters": {name: str(d) for name, d in adapters.items()},
        "plain": (plain, _reference(path, adapters, plain)),
        "shared": (shared, _reference(path, adapters, shared)),
    }


def _engine(setup: dict, **config: object) -> Engine:
    """An engine with every adapter registered, resident together unless ``max_loras`` says
    fewer."""
    config.setdefault("max_loras", len(ADAPTERS))
    return Engine(setup["path"], lora_adapters=setup["adapters"], **config)


def _run(
    engine: Engine, cases: list[Case], reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> dict[str, int]:
    """Run ``cases`` together; check every line against ``reference`` and return the most
    adapters (and base) whose rows shared one step, and the most adapters resident at once."""
    seen = {"mixed": 0, "resident": 0, "stacks": 0, "runs": 0, "segments": 0}
    prepare = engine.runner.prepare

    def watched(scheduled):  # type: ignore[no-untyped-def]
        batch = prepare(scheduled)
        loras = {seq.request.lora for seq, _ in scheduled}
        seen["mixed"] = max(seen["mixed"], len(loras))
        step = batch.lora
        if step is not None:
            # every adapter of the step in the one forward, in one of LoraStep's layouts
            if step.stacks is not None:
                assert step.row_slot is not None
                adapters = len(set(step.row_slot.tolist()) - {-1})
                seen["stacks"] += 1
            elif step.runs is not None:
                adapters = len({id(weights) for weights, _, _ in step.runs})
                seen["runs"] += adapters > 1
            else:
                adapters = len(step.segments)
                seen["segments"] += adapters > 1
            assert adapters == len(loras - {None})
        seen["resident"] = max(seen["resident"], len(engine.runner.loras.resident))
        return batch

    monkeypatch.setattr(engine.runner, "prepare", watched)
    for i, case in enumerate(cases):
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), case.prompt, params, lora=case.lora)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        steps += 1
        assert steps < 10_000
    for i, case in enumerate(cases):
        got = done[str(i)].outputs[0].token_ids
        assert got == reference[i], f"line {i} (adapter {case.lora}) diverged"
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert not engine.runner.loras.pins, "every adapter is let go once its sequences finish"
    return seen


def test_adapters_change_the_output(setup: dict) -> None:
    """The oracle means something: on the same prompt each adapter's reference differs from
    the base's."""
    cases, ref = setup["shared"]
    for lora in ADAPTERS:
        differ = [
            ref[i] != ref[i - LINES.index(lora)] for i, c in enumerate(cases) if c.lora == lora
        ]
        assert any(differ), f"adapter {lora} changes nothing"


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "generic"])
def test_mixed_batch(setup: dict, lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every adapter and the base in the same steps, on the lean Llama forward (fused q/k/v
    and gate/up, each slice its own delta) and on transformers' forward (``cpu_kernels``
    off: plain linear layers). Prefill steps take each adapter's rows as ranges, decode steps
    the stacked weights."""
    cases, ref = setup["plain"]
    engine = _engine(setup, cpu_kernels=lean)
    assert (engine.runner.lean is not None) is lean
    seen = _run(engine, cases, ref, monkeypatch)
    assert seen["mixed"] == len(LINES), "all the adapters and the base shared a step"
    assert seen["stacks"] and seen["runs"], seen
    assert engine.stats().num_lora_evictions == 0


def test_mixed_batch_gathered(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither stacks nor ranges: every step's adapted rows gathered and scattered."""
    monkeypatch.setattr(manager, "STACKED_MAX_ROWS", 0)
    monkeypatch.setattr(manager, "RUNS_PER_ADAPTER", 0)
    cases, ref = setup["plain"]
    engine = _engine(setup)
    seen = _run(engine, cases, ref, monkeypatch)
    assert seen["segments"] and not seen["stacks"] and not seen["runs"], seen


def test_generic_forward_fused(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' forward over fused projections (what a non-Llama model runs on a CPU):
    the lean forward set aside, each fused layer's slices read their part of the delta."""
    cases, ref = setup["plain"]
    engine = _engine(setup)
    engine.runner.lean = None
    _run(engine, cases, ref, monkeypatch)


def test_preemption(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cases, ref = setup["plain"]
    engine = _engine(setup, num_kv_blocks=24, max_num_seqs=64)
    _run(engine, cases, ref, monkeypatch)
    assert engine.stats().num_preemptions > 0


def test_chunked_prefill(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cases, ref = setup["plain"]
    engine = _engine(setup, max_num_batched_tokens=48, enable_prefix_caching=False)
    _run(engine, cases, ref, monkeypatch)
    assert engine.stats().num_chunked_prefills > 0


def test_prefix_caching_across_adapters(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts shared across adapters, with chunks and preemption: each adapter reads back
    only its own cached blocks."""
    cases, ref = setup["shared"]
    engine = _engine(setup, num_kv_blocks=40, max_num_batched_tokens=64, admission="fcfs")
    _run(engine, cases, ref, monkeypatch)
    stats = engine.stats()
    assert stats.total_cached_tokens > 0
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0


def test_more_adapters_than_max_loras(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five adapters, two slots: requests wait for a slot, the least recently used adapter no
    running sequence holds is evicted and loaded again later."""
    cases, ref = setup["plain"]
    engine = _engine(setup, max_loras=2)
    seen = _run(engine, cases, ref, monkeypatch)
    assert seen["resident"] == 2
    assert seen["mixed"] == 3, "two adapters and the base, never more"
    stats = engine.stats()
    assert stats.num_loras_resident == 2 and stats.num_loras_registered == len(ADAPTERS)
    assert stats.num_lora_evictions > 0
    assert stats.num_lora_loads == stats.num_lora_evictions + 2
    assert stats.lora_memory_bytes > 0


def test_a_request_waits_for_a_slot(setup: dict) -> None:
    """One slot: a request of a second adapter is not admitted while the first adapter's
    request runs, though there is room for it, and runs once the slot is free."""
    engine = _engine(setup, max_loras=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params, lora="qv8")
    engine.add_request("b", [5, 6, 7], params, lora="mlp16")
    engine.add_request("base", [5, 6, 7], params)
    engine.step()
    running = {seq.request.request_id for seq in engine.scheduler.running}
    assert running == {"a", "base"}
    assert list(engine.runner.loras.resident) == ["qv8"]
    done = set()
    while engine.has_unfinished_requests():
        done.update(out.request_id for out in engine.step())
    assert done == {"a", "b", "base"}
    assert list(engine.runner.loras.resident) == ["mlp16"]


def test_add_lora_at_runtime(
    setup: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine started without adapters registers them with ``add_lora``: its layers are
    wrapped then, the lean forward rebuilt over them; the log says their memory is not in the
    KV budget."""
    cases, ref = setup["plain"]
    engine = Engine(setup["path"], max_loras=len(ADAPTERS))
    assert engine.runner.loras.sites is None
    with caplog.at_level("WARNING", logger="engine"):
        for name, directory in setup["adapters"].items():
            engine.add_lora(name, directory)
    assert "registered at runtime: the resident set may take" in caplog.text
    assert engine.runner.lean is not None
    _run(engine, cases, ref, monkeypatch)


def test_cache_blocks_never_cross_adapters(setup: dict) -> None:
    """The same 64-token prompt under two adapters and the base: a request reuses the cached
    blocks of its own adapter only; and two requests of different adapters running together
    hold no block in common."""
    engine = _engine(setup)
    prompt = [random.Random(7).randrange(3, VOCAB) for _ in range(64)]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(request_id: str, lora: str | None) -> int:
        engine.add_request(request_id, prompt, params, lora=lora)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        (out,) = outs
        return out.metrics.num_cached_tokens

    assert cached("qv8-1", "qv8") == 0
    assert cached("mlp16-1", "mlp16") == 0
    assert cached("base-1", None) == 0
    assert cached("qv8-2", "qv8") == 48  # three full blocks; the last token is computed
    assert cached("mlp16-2", "mlp16") == 48
    assert cached("base-2", None) == 48

    other = [t + 1 for t in prompt]
    longer = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("x", other, longer, lora="qv8")
    engine.add_request("y", other, longer, lora="all4")
    engine.add_request("z", other, longer)
    engine.step()
    tables = {
        seq.request.request_id: set(seq.block_table)
        for seq in engine.scheduler.running
        if seq.block_table
    }
    assert set(tables) == {"x", "y", "z"}
    assert not tables["x"] & tables["y"] and not tables["x"] & tables["z"]
    assert not tables["y"] & tables["z"]
    while engine.has_unfinished_requests():
        engine.step()


def test_lora_memory_comes_off_the_kv_budget(setup: dict) -> None:
    """What the resident set may take comes off the KV budget: ``max_loras`` slots of the
    largest configured adapter and of the stacks (each layer at the largest rank any adapter
    gives it); the resident set, every adapter loaded, stays within it."""
    plain = Engine(setup["path"], kv_cache_memory=64 << 20)
    adapted = _engine(setup, kv_cache_memory=64 << 20, max_loras=3)
    loras = adapted.runner.loras
    largest = max(loras.adapter_bytes(spec) for spec in loras.specs.values())
    envelope = 0
    for path, (n_in, n_out) in loras.linears.items():
        ranks = [s.modules[path].rank for s in loras.specs.values() if path in s.modules]
        envelope += max(ranks, default=0) * (n_in + n_out) * 4  # float32
    assert loras.reserved_bytes == 3 * (largest + envelope) > 0
    per_block = plain.runner.bytes_per_block
    assert plain.runner.num_blocks - adapted.runner.num_blocks == pytest.approx(
        loras.reserved_bytes / per_block, abs=1
    )
    for name in ("all4", "mlp16", "qd12"):
        assert loras.acquire(name)
    assert 0 < loras.resident_bytes <= loras.reserved_bytes
    assert adapted.stats().lora_memory_bytes == loras.resident_bytes


def test_model_runner_without_adapters_is_untouched(setup: dict) -> None:
    """No adapter registered: no layer is wrapped, and a step has no adapter rows."""
    engine = Engine(setup["path"])
    runner: ModelRunner = engine.runner
    assert runner.loras.sites is None
    assert not any(type(m).__name__ == "LoraLinear" for m in runner.model.modules())


def test_a_model_of_another_family(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2 (biases on q/k/v, no lean forward): transformers' forward over its fused
    projections, every adapter and the base mixed, each line peft's merged model's."""
    path = str(build("qwen2-tiny"))
    root = tmp_path_factory.mktemp("qwen2-adapters")
    adapters = {
        name: make_adapter(path, root / name, rank=rank, target_modules=targets, seed=seed)
        for name, (rank, targets, seed) in ADAPTERS.items()
    }
    cases = _cases(3, 18, shared_prefixes=False)
    ref = _reference(path, adapters, cases)
    engine = Engine(
        path, lora_adapters={n: str(d) for n, d in adapters.items()}, max_loras=len(ADAPTERS)
    )
    assert engine.runner.lean is None
    seen = _run(engine, cases, ref, monkeypatch)
    assert seen["mixed"] == len(LINES)
