"""The simulated engine (``engine.sim.simulator``): what it produces is a pure function of each
request, it admits like the real scheduler, and its statistics agree with its outputs.

Every test counts engine work (virtual steps, tokens), never wall time: a call of
``SimEngine.step`` covers at most ``MAX_CALL_S * tokens_per_s`` virtual steps whatever the
machine does, so a request longer than that is still running after one call."""

from __future__ import annotations

from typing import Any

import pytest

from core.llms import specs
from engine import EngineHost, RequestError, RequestOutput, SamplingParams
from engine.core.urgent import UrgentReservation
from engine.sim.simulator import MAX_CALL_S, SimEngine
from engine.text.tokenizer import load_tokenizer

RATE = 1000.0  # virtual steps per second: a call covers 2 to 20 of them
CALL_MAX = round(MAX_CALL_S * RATE)


@pytest.fixture(scope="module")
def tok(path: str) -> Any:
    return load_tokenizer(path)


def sim(tok: Any, **kwargs: Any) -> SimEngine:
    kwargs.setdefault("tokens_per_s", RATE)
    kwargs.setdefault("ttft_ms", 0)
    return SimEngine(tok, **kwargs)


def drain(engine: SimEngine) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def prompts(n: int, offset: int = 0) -> list[list[int]]:
    return [[10 + (i + offset) % 50, 20 + i % 7, 30, 40 + i] for i in range(n)]


def shape(out: RequestOutput) -> list[tuple[int, list[int], str, str | None]]:
    return [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def test_outputs_are_a_function_of_the_request_alone(tok: Any) -> None:
    ps = prompts(12)
    params = [SamplingParams(max_tokens=3 + 2 * i, n=1 + i % 3) for i in range(12)]
    alone = sim(tok, max_num_seqs=2)
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        alone.add_request(f"r{i}", p, sp)
    first = drain(alone)
    # Another engine, another cap, the requests in reverse order among others.
    mixed = sim(tok, max_num_seqs=32)
    for j, p in enumerate(prompts(20, offset=7)):
        mixed.add_request(f"other{j}", p, SamplingParams(max_tokens=5))
    for i in reversed(range(12)):
        mixed.add_request(f"r{i}", ps[i], params[i])
    second = drain(mixed)
    for i in range(12):
        assert shape(first[f"r{i}"]) == shape(second[f"r{i}"])
        out = first[f"r{i}"]
        assert [len(c.token_ids) for c in out.outputs] == [params[i].max_tokens] * params[i].n
        assert {c.finish_reason for c in out.outputs} == {"length"}
        for c in out.outputs:
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
            assert c.text.strip()
    # Different prompts and different completions of one prompt differ.
    assert first["r0"].outputs[0].token_ids != first["r1"].outputs[0].token_ids[:3]
    two = first["r1"].outputs
    assert two[0].token_ids != two[1].token_ids


def test_lengths_hash_is_deterministic_and_within_max_tokens(tok: Any) -> None:
    def run() -> dict[str, RequestOutput]:
        engine = sim(tok, lengths="hash", max_num_seqs=8)
        for i, p in enumerate(prompts(40)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20))
        engine.add_request("eos", prompts(1)[0], SamplingParams(max_tokens=20, ignore_eos=True))
        return drain(engine)

    a, b = run(), run()
    assert {k: shape(v) for k, v in a.items()} == {k: shape(v) for k, v in b.items()}
    lengths = [len(a[f"r{i}"].outputs[0].token_ids) for i in range(40)]
    assert all(1 <= n <= 20 for n in lengths) and len(set(lengths)) > 5
    for i in range(40):
        c = a[f"r{i}"].outputs[0]
        assert c.finish_reason == ("length" if len(c.token_ids) == 20 else "stop")
    assert len(a["eos"].outputs[0].token_ids) == 20


def test_context_clamps_the_output_and_refusals_match_the_engine(tok: Any) -> None:
    engine = sim(tok, max_model_len=16)
    engine.add_request("long", list(range(10, 22)), SamplingParams(max_tokens=50))
    out = drain(engine)["long"].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    refusals = {
        "empty": ([], "invalid_prompt"),
        "vocab": ([5, len(tok)], "invalid_prompt"),
        "bool": ([5, True], "invalid_prompt"),  # an int by isinstance, not a token id
        "full": (list(range(10, 26)), "context_length_exceeded"),
    }
    for name, (prompt, code) in refusals.items():
        with pytest.raises(RequestError) as err:
            engine.add_request(name, prompt)
        assert err.value.code == code
    engine.add_request("dup", [5, 6])
    with pytest.raises(RequestError) as err:
        engine.add_request("dup", [5, 6])
    assert err.value.code == "duplicate_request_id"


def test_admission_is_capped_and_first_come_first_served(tok: Any) -> None:
    engine = sim(tok, max_num_seqs=3)
    long = SamplingParams(max_tokens=CALL_MAX * 10)  # runs for many calls
    for i in range(6):
        engine.add_request(f"r{i}", prompts(6)[i], long)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (3, 3)
    running = {s.request.request_id for s in engine.scheduler.running.values()}
    assert running == {"r0", "r1", "r2"}
    # Lower priority values first among those waiting (the real scheduler's order).
    engine.add_request("urgent", [7, 8, 9], long, priority=-1)
    engine.abort_request("r1")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["r1"].outputs[0].finish_reason == "abort"
    running = {s.request.request_id for s in engine.scheduler.running.values()}
    assert running == {"r0", "r2", "urgent"}
    rest = drain(engine)
    assert set(rest) == {"r0", "r2", "r3", "r4", "r5", "urgent"}


def test_urgent_reservation_preempts_the_newest_and_loses_nothing(tok: Any) -> None:
    engine = sim(tok, max_num_seqs=2)
    engine.scheduler.reserve_for_urgent(UrgentReservation(1, 0))
    long = SamplingParams(max_tokens=CALL_MAX * 4)
    engine.add_request("old", [5, 6], long)
    engine.add_request("new", [6, 7], long)
    engine.step()
    engine.add_request("urgent", [7, 8], long, priority=-1)
    engine.step()
    running = {s.request.request_id for s in engine.scheduler.running.values()}
    assert running == {"old", "urgent"}
    outputs = drain(engine)
    assert engine.stats().num_preemptions == 1
    reference = sim(tok)
    reference.add_request("new", [6, 7], long)
    assert shape(outputs["new"]) == shape(drain(reference)["new"])


def test_suspend_resume_and_split_completions_give_the_same_output(tok: Any) -> None:
    params = SamplingParams(max_tokens=CALL_MAX * 3, n=3)
    whole = sim(tok)
    whole.add_request("x", [9, 8, 7], params)
    expected = shape(drain(whole)["x"])

    engine = sim(tok, max_num_seqs=8)
    single = SamplingParams(max_tokens=params.max_tokens)
    for i in range(3):
        engine.add_request(f"x{i}", [9, 8, 7], single, completion_index=i)
    engine.step()
    handle = engine.suspend_request("x1")
    assert handle is not None and engine.stats().num_suspended == 1
    engine.step()
    engine.resume_request(handle)
    outputs = drain(engine)
    got = [shape(outputs[f"x{i}"])[0] for i in range(3)]
    assert got == expected
    assert engine.stats().total_prompt_tokens == 3  # completion 0 counts the prompt


def test_stats_and_metrics_agree_with_the_outputs(tok: Any) -> None:
    engine = sim(tok, max_num_seqs=4, lengths="hash")
    ps = prompts(15)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=CALL_MAX + i, n=1 + i % 2))
    engine.step()
    engine.step()
    engine.abort_request("r0")  # partial tokens count, as in the real engine
    outputs = drain(engine)
    stats = engine.stats()
    completions = [c for o in outputs.values() for c in o.outputs]
    assert stats.total_output_tokens == sum(len(c.token_ids) for c in completions)
    assert 0 < len(outputs["r0"].outputs[0].token_ids) < CALL_MAX
    assert stats.total_prompt_tokens == sum(len(p) for p in ps)
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.total_cached_tokens == 0 and stats.prefix_cache_hit_rate == 0.0
    assert stats.total_running_seq_steps <= stats.num_steps * 4
    metrics = engine.metrics
    assert metrics is not None
    finished = [o for k, o in outputs.items() if k != "r0"]
    reasons: dict[str, int] = {}
    for o in finished:
        reason = o.outputs[0].finish_reason or "unknown"
        reasons[reason] = reasons.get(reason, 0) + 1
    assert metrics.finished_by_reason() == reasons
    hist = metrics.histograms()
    assert hist["e2e_request_latency_seconds"].count == len(finished)
    assert hist["time_to_first_token_seconds"].count == len(outputs)  # r0 had its first token
    firsts = sum(1 for c in completions if c.token_ids)
    assert hist["inter_token_latency_seconds"].count == stats.total_output_tokens - firsts
    assert hist["step_time_seconds"].count == stats.num_steps
    for out in outputs.values():
        m = out.metrics
        assert m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_under_the_host_with_nothing_left_behind(tok: Any) -> None:
    engine = sim(tok, max_num_seqs=4)
    with EngineHost(engine) as host:
        futures = {
            f"r{i}": host.submit(p, SamplingParams(max_tokens=6, n=1 + i % 3), group=f"g{i % 2}")
            for i, p in enumerate(prompts(10))
        }
        results = {k: f.result(timeout=60) for k, f in futures.items()}
        stats = host.stats()
    reference = sim(tok)
    for i, p in enumerate(prompts(10)):
        reference.add_request(f"r{i}", p, SamplingParams(max_tokens=6, n=1 + i % 3))
    expected = drain(reference)
    assert {k: shape(v) for k, v in results.items()} == {k: shape(v) for k, v in expected.items()}
    assert stats.completed == 10 and stats.engine is not None
    assert stats.engine.total_prompt_tokens == sum(len(p) for p in prompts(10))
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine._finishes and not engine._starts and not engine.scheduler.waiting.by_priority


def test_engine_options_of_the_real_engine_are_accepted(tok: Any) -> None:
    engine = sim(tok, dtype="float32", device="cpu", kv_cache_memory=0.5, max_num_seqs=7)
    assert engine.config.max_num_seqs == 7 and engine.max_model_len == 8192
    with pytest.raises(ValueError, match="unknown engine config field"):
        sim(tok, flavour="x")
    with pytest.raises(ValueError, match="tokens_per_s"):
        SimEngine(tok, tokens_per_s=0, ttft_ms=0)


def test_spec_options_and_their_errors() -> None:
    spec = "sim:tokens_per_s=4000,max_num_seqs=256,ttft_ms=50,tokenizer=demo:llama-tiny"
    parsed = specs.sim_spec(spec)
    assert parsed.engine_kwargs() == {
        "tokens_per_s": 4000.0,
        "ttft_ms": 50.0,
        "lengths": "max",
        "max_num_seqs": 256,
    }
    assert specs.kind_of(spec) == "generate"
    assert specs.source_spec(spec) == "demo:llama-tiny"
    assert specs.source_spec("sim:") == specs.SIM_DEFAULT_TOKENIZER
    with pytest.raises(ValueError) as err:
        specs.sim_spec("sim:tokens_per_s=10,speed=2")
    assert "'speed'" in str(err.value) and "tokens_per_s, ttft_ms, max_num_seqs" in str(err.value)
    for bad, words in [
        ("sim:tokens_per_s=-1", "tokens_per_s must be a positive number"),
        ("sim:max_num_seqs=0", "max_num_seqs must be an integer >= 1"),
        ("sim:lengths=short", "lengths must be 'max' or 'hash'"),
        ("sim:ttft_ms", "'ttft_ms' needs a value"),
    ]:
        with pytest.raises(ValueError, match=words):
            specs.sim_spec(bad)
