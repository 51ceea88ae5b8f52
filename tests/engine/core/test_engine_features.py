"""Sampling, stops, n > 1, logprobs, aborts and request errors, on the tiny demo model."""

from __future__ import annotations

import random

import pytest
import torch

from core.llms.demo import build
from engine import LLM, Engine, EngineConfig, RequestError, SamplingParams
from engine.core.outputs import RequestMetrics
from engine.core.sampler import Sampler
from engine.core.sequence import Request, Sequence


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def _drain(engine: Engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return done


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=200, seed=1234, ignore_eos=True
    )
    target = _prompt(1, 37)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [_prompt(10 + i, 5 + 23 * i) for i in range(9)]
    other_params = [
        SamplingParams(
            max_tokens=5 + 3 * i, temperature=1.0, seed=i if i % 2 else None, ignore_eos=True
        )
        for i in range(9)
    ]
    crowded = llm.generate(
        others[:4] + [target] + others[4:],
        other_params[:4] + [params] + other_params[4:],
        use_tqdm=False,
    )
    assert crowded[4].outputs[0].token_ids == alone
    reordered = llm.generate([target] + others[::-1], [params] + other_params[::-1], use_tqdm=False)
    assert reordered[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=200, seed=99, ignore_eos=True
    )
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_is_trimmed(llm: LLM) -> None:
    prompt = _prompt(2, 20)
    base = llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )
    text = base[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "\x00never"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < 30


def test_stop_token_ids(llm: LLM) -> None:
    prompt = _prompt(3, 12)
    tokens = (
        llm.generate(
            [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = tokens[6]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_n_completions_share_prompt_blocks_and_match_single_seeds(path: str) -> None:
    engine = Engine(path)
    prompt = _prompt(4, 40)  # 2 full blocks + 8 tokens
    engine.add_request(
        "n", prompt, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=50, ignore_eos=True)
    )
    assert engine.step() == []
    request = engine.requests["n"]
    assert len(request.seqs) == 3
    parent = request.seqs[0]
    for child in request.seqs[1:]:
        assert child.block_table[:2] == parent.block_table[:2]
    assert engine.block_manager.ref_count[parent.block_table[0]] == 3
    out = _drain(engine)["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert engine.stats().kv_blocks_used == 0
    for i in range(len(out.outputs)):
        engine.add_request(
            f"s{i}",
            prompt,
            SamplingParams(max_tokens=12, temperature=1.0, seed=50 + i, ignore_eos=True),
        )
    singles = _drain(engine)
    for i, completion in enumerate(out.outputs):
        assert completion.token_ids == singles[f"s{i}"].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_the_model(llm: LLM, path: str, temperature: float) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _prompt(5, 25)
    params = SamplingParams(
        max_tokens=8,
        temperature=temperature,
        seed=3,
        logprobs=True,
        top_logprobs=5,
        ignore_eos=True,
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    logits = logits[len(prompt) - 1 : -1] / (temperature or 1.0)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        values, ids = ref[i].topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_penalties_follow_openai_semantics() -> None:
    request = Request(
        "p",
        [1, 2],
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        RequestMetrics(arrival_time=0.0),
    )
    seq = Sequence(request, 0, [1, 2, 5, 5, 7], 20, None)
    logits = torch.zeros(1, 10)
    logits[0, 5] = 2.1  # 2.1 - 1.0 - 2 * 0.5 = 0.1
    logits[0, 7] = 1.4  # 1.4 - 1.0 - 0.5 = -0.1
    logits[0, 1] = 0.2  # prompt tokens are not penalized
    tokens, _ = Sampler(0, torch.device("cpu"))(logits, [seq])
    assert tokens == [1]
    logits[0, 1] = 0.05
    assert Sampler(0, torch.device("cpu"))(logits, [seq])[0] == [5]


def test_abort_frees_blocks_and_reports(path: str) -> None:
    engine = Engine(path)
    for i in range(3):
        engine.add_request(
            f"a{i}", _prompt(20 + i, 50), SamplingParams(max_tokens=50, ignore_eos=True)
        )
    engine.step()
    engine.step()
    used = engine.stats().kv_blocks_used
    assert engine.abort_request("a1") is True
    assert engine.abort_request("a1") is False
    assert engine.abort_request("missing") is False
    assert engine.stats().kv_blocks_used < used
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a1"]
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) >= 1
    done = _drain(engine)
    assert set(done) == {"a0", "a2"}
    assert engine.stats().kv_blocks_used == 0
    # Aborting a request that is still waiting works too.
    engine.add_request("w", _prompt(30, 10), SamplingParams(max_tokens=5))
    assert engine.abort_request("w")
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()


def test_a_request_that_cannot_run_fails_alone(llm: LLM, path: str) -> None:
    limit = llm.engine.max_model_len
    prompts = [_prompt(6, 10), _prompt(7, limit + 5), [], _prompt(8, 30)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 0, 0, 1]
    assert "max_model_len" in outs[1].error and str(limit) in outs[1].error
    assert "empty" in outs[2].error
    assert outs[0].error is None and len(outs[3].outputs[0].token_ids) == 4
    with pytest.raises(RequestError, match="vocabulary") as bad:
        llm.engine.add_request("bad", [1, 999999], SamplingParams())
    assert bad.value.code == "invalid_prompt"
    with pytest.raises(RequestError) as too_long:
        llm.engine.add_request("long", _prompt(7, limit + 5), SamplingParams())
    assert too_long.value.code == "context_length_exceeded"
    small = Engine(path, num_kv_blocks=4)
    with pytest.raises(RequestError, match="4 blocks") as too_big:
        small.add_request("big", _prompt(9, 60), SamplingParams(max_tokens=10))
    assert too_big.value.code == "kv_cache_too_small"
    small.add_request("ok", _prompt(9, 30), SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(_drain(small)["ok"].outputs[0].token_ids) == 10


def test_prompt_plus_max_tokens_is_clamped_to_max_model_len(path: str) -> None:
    engine = Engine(path, max_model_len=40)
    engine.add_request("c", _prompt(11, 30), SamplingParams(max_tokens=100, ignore_eos=True))
    out = _drain(engine)["c"].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_chat_applies_the_template(llm: LLM) -> None:
    conv = [{"role": "user", "content": "hello world"}]
    outs = llm.chat(conv, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(outs) == 1 and outs[0].error is None
    tail = llm.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert outs[0].prompt_token_ids[-len(tail) :] == tail
    both = llm.chat(
        [
            conv,
            conv + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
        ],
        SamplingParams(max_tokens=3, temperature=0),
        use_tqdm=False,
    )
    assert both[0].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]


def test_generate_accepts_a_single_prompt_and_metrics(llm: LLM) -> None:
    out = llm.generate(
        "the quick brown fox", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False
    )
    assert len(out) == 1
    m = out[0].metrics
    assert (
        m.first_token_time is not None and m.finished_time >= m.first_token_time >= m.arrival_time
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"regex": ""}, "regex"),
        ({"choice": ["a", ""]}, "choice"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_sampling_params_normalises() -> None:
    p = SamplingParams(stop="x", top_logprobs=3)
    assert p.stop == ["x"] and p.logprobs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": 1.5}, "kv_cache_memory"),
        ({"admission": "random"}, "admission"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"bogus": 1}, "unknown engine config field"),
    ],
)
def test_engine_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_max_num_seqs_defaults_by_device(path: str) -> None:
    """Unset, the running-set cap is the device's: 128 on a CPU and on an accelerator; a
    given value is kept."""
    config = EngineConfig()
    assert config.max_num_seqs is None
    assert config.for_device("cpu").max_num_seqs == 128
    assert config.for_device("cuda").max_num_seqs == 128
    assert EngineConfig(max_num_seqs=7).for_device("cpu").max_num_seqs == 7
    assert Engine(path, device="cpu", num_kv_blocks=64).config.max_num_seqs == 128
    assert Engine(path, device="cpu", num_kv_blocks=64, max_num_seqs=5).config.max_num_seqs == 5


def test_engine_rejects_unknown_config(path: str) -> None:
    with pytest.raises(ValueError, match="unknown engine config field"):
        Engine(path, max_batch=3)


@pytest.mark.parametrize("admission", ["batch", "fcfs"])
def test_priority_is_admitted_first(admission: str) -> None:
    """With one sequence slot, a more urgent request queued last is admitted before the others
    (lower priority value first), whatever the admission policy."""
    engine = Engine(str(build("llama-tiny")), max_num_seqs=1, admission=admission)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("bulk-0", [5, 6, 7], params, priority=1)
    engine.add_request("bulk-1", [5, 6, 8], params, priority=1)
    engine.add_request("normal", [9, 10, 11], params)
    engine.add_request("urgent", [12, 13], params, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == ["urgent", "normal", "bulk-0", "bulk-1"]


def _run_n(path: str, max_num_seqs: int, caching: bool) -> tuple[dict, int]:
    """Two ``n = 8`` requests (one greedy, one seeded); the outputs and the most sequences
    ever running after a step."""
    engine = Engine(path, max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    engine.add_request(
        "greedy", _prompt(40, 37), SamplingParams(n=8, max_tokens=9, temperature=0, ignore_eos=True)
    )
    engine.add_request(
        "seeded",
        _prompt(41, 50),
        SamplingParams(n=8, max_tokens=9, temperature=1.0, seed=7, ignore_eos=True),
    )
    done: dict = {}
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        peak = max(peak, engine.stats().num_running)
    assert engine.stats().kv_blocks_used == 0
    return done, peak


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_n_forks_never_exceed_max_num_seqs(path: str, caching: bool) -> None:
    capped, peak = _run_n(path, 4, caching)
    assert peak == 4
    roomy, roomy_peak = _run_n(path, 16, caching)
    assert roomy_peak == 16  # with room, every fork runs at once
    for request_id in ("greedy", "seeded"):
        outputs = capped[request_id].outputs
        assert [c.index for c in outputs] == list(range(8))
        assert all(len(c.token_ids) == 9 and c.finish_reason == "length" for c in outputs)
        assert [c.token_ids for c in outputs] == [c.token_ids for c in roomy[request_id].outputs]
    assert len({tuple(c.token_ids) for c in capped["greedy"].outputs}) == 1
    assert len({tuple(c.token_ids) for c in capped["seeded"].outputs}) > 1


def test_waiting_forks_are_aborted_with_their_request(path: str) -> None:
    engine = Engine(path, max_num_seqs=2)
    engine.add_request("n", _prompt(42, 20), SamplingParams(n=5, max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 3
    assert engine.abort_request("n")
    out = engine.step()[0]
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 5
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


def test_preemption_counts_each_prompt_once(path: str) -> None:
    """A preempted sequence is admitted again; its prompt (and cache hit) counts once."""
    prompts = [_prompt(50 + i, 60) for i in range(6)]
    engine = Engine(path, num_kv_blocks=14, max_num_seqs=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
    done = _drain(engine)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.total_prompt_tokens == sum(map(len, prompts))
    assert stats.total_cached_tokens == sum(o.metrics.num_cached_tokens for o in done.values())
    assert stats.prefix_cache_hit_rate == stats.total_cached_tokens / stats.total_prompt_tokens


def test_cache_salt_scopes_the_prefix_cache(llm: LLM) -> None:
    prompt = _prompt(60, 80)  # 5 full blocks: a hit is 64 tokens (the last block is computed)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(salt: str | None) -> tuple[int, list[int]]:
        out = llm.generate([prompt], params, use_tqdm=False, cache_salt=salt)[0]
        return out.metrics.num_cached_tokens, out.outputs[0].token_ids

    first, tokens = run("tenant-a")
    assert first == 0
    assert run("tenant-b") == (0, tokens)
    assert run(None) == (0, tokens)
    assert run("tenant-a") == (64, tokens)
    assert run("tenant-b") == (64, tokens)
    assert run(None) == (64, tokens)
    with pytest.raises(RequestError, match="cache_salt"):
        llm.engine.add_request("salt", prompt, params, cache_salt="")


def test_a_suspended_request_resumes_with_the_same_output(path: str) -> None:
    prompts = [_prompt(40 + i, 20 + 7 * i) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = LLM(path).generate(prompts, params, use_tqdm=False)
    engine = Engine(path, block_size=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(6):
        engine.step()
    used = engine.block_manager.num_used_blocks
    suspended = engine.suspend_request("r1")
    assert suspended is not None
    assert engine.block_manager.num_used_blocks < used  # its room is free at once
    assert engine.suspend_request("r1") is None  # no longer in the engine
    done = {}
    for _ in range(10):
        for out in engine.step():
            done[out.request_id] = out
    engine.resume_request(suspended)
    with pytest.raises(RequestError):
        engine.resume_request(suspended)
    done.update(_drain(engine))
    assert engine.stats().num_suspended == 1
    for i, want in enumerate(alone):
        assert done[f"r{i}"].outputs[0].token_ids == want.outputs[0].token_ids


def test_only_single_unfinished_requests_can_be_suspended(path: str) -> None:
    engine = Engine(path)
    engine.add_request("multi", [5, 6, 7], SamplingParams(max_tokens=4, n=2))
    assert engine.suspend_request("multi") is None
    assert engine.suspend_request("unknown") is None
    engine.add_request("waiting", [5, 6, 7], SamplingParams(max_tokens=4))
    suspended = engine.suspend_request("waiting")  # not yet admitted: leaves the queue
    assert suspended is not None
    _drain(engine)
    engine.resume_request(suspended)
    out = _drain(engine)["waiting"]
    assert len(out.outputs[0].token_ids) == 4


def test_a_completion_index_samples_as_that_completion_and_counts_once(path: str) -> None:
    """An n > 1 request split by its caller into single requests with ``completion_index``
    gives the completions the engine's own fork gives, and counts as one request."""
    engine = Engine(path)
    prompt = _prompt(70, 40)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
    engine.add_request("n", prompt, params)
    forked = _drain(engine)["n"]
    before = engine.stats()
    e2e_before = engine.metrics.e2e_request_latency_s.snapshot().count
    single = SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"c{i}", prompt, single, completion_index=i)
    done = _drain(engine)
    split = [done[f"c{i}"].outputs for i in range(3)]
    assert [len(outs) for outs in split] == [1, 1, 1]
    assert [outs[0].index for outs in split] == [0, 1, 2]
    assert [outs[0].token_ids for outs in split] == [c.token_ids for c in forked.outputs]
    stats = engine.stats()
    assert stats.total_prompt_tokens - before.total_prompt_tokens == len(prompt)
    assert engine.metrics.e2e_request_latency_s.snapshot().count - e2e_before == 1
    with pytest.raises(RequestError, match="completion_index"):
        engine.add_request("bad", prompt, params, completion_index=1)
