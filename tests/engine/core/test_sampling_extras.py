"""vLLM's sampling extensions in the engine: ``repetition_penalty``, ``min_tokens`` and
``stop_token_ids`` give, greedily, what transformers' ``generate()`` gives under the same knob
(``repetition_penalty``, ``min_new_tokens``, an ``eos_token_id`` list), one request at a time
there and all of them in one batch here; ``min_p`` is transformers' filter; ``regex`` and
``choice`` constrain the output; ``skip_special_tokens`` decides the text."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest
import torch

from engine import LLM, Engine, SamplingParams
from engine.core.outputs import RequestMetrics
from engine.core.sampler import min_p_filter, repetition_penalty_
from engine.core.sequence import Request, Sequence

MAX_TOKENS = 12


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(35)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(2, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _generate(model: Any, prompt: list[int], eos: list[int] | None, **knobs: Any) -> list[int]:
    """transformers' greedy continuation, stopping at ``eos`` (None: never)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos
    config.pad_token_id = eos[0] if eos else 0
    config.max_new_tokens = MAX_TOKENS
    config.do_sample = False
    for name, value in knobs.items():
        setattr(config, name, value)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def _first_new(tokens: list[int], at_least: int) -> int:
    """The index (from ``at_least`` on) of a token that does not occur before it."""
    return next(j for j in range(at_least, len(tokens)) if tokens[j] not in tokens[:j])


def _run_together(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


def test_greedy_extensions_equal_transformers_generate(path: str, hf: Any) -> None:
    """Every case runs in one engine batch, beside plain requests; transformers runs each
    alone. Each case is built to change the output (checked), so equality means the knob is
    honoured, not ignored."""
    engine = Engine(path)
    eos = sorted(engine.eos_token_ids)
    prompts = _prompts(12)
    plain = [_generate(hf, p, None) for p in prompts]
    params: list[SamplingParams] = []
    expected: list[list[int]] = []
    base = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    for i, (prompt, ref) in enumerate(zip(prompts, plain, strict=True)):
        kind = i % 4
        if kind == 0:  # the plain run, with eos honoured
            params.append(SamplingParams(**base, ignore_eos=True))
            expected.append(ref)
        elif kind == 1:
            penalty = 1.5 if i % 8 == 1 else 0.7
            params.append(SamplingParams(**base, ignore_eos=True, repetition_penalty=penalty))
            expected.append(_generate(hf, prompt, None, repetition_penalty=penalty))
        elif kind == 2:  # stop at a token the plain run produces
            j = _first_new(ref, 2)
            params.append(SamplingParams(**base, stop_token_ids=[ref[j]]))
            want = _generate(hf, prompt, [ref[j], *eos])
            assert want == ref[: j + 1]
            expected.append(want)
        else:  # that stop token held back by min_tokens
            j = _first_new(ref, 1)
            params.append(SamplingParams(**base, stop_token_ids=[ref[j]], min_tokens=j + 3))
            want = _generate(hf, prompt, [ref[j], *eos], min_new_tokens=j + 3)
            assert len(want) > j + 3 and ref[j] not in want[: j + 3]
            expected.append(want)
    outs = _run_together(engine, prompts, params)
    for i, (out, want) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == want, f"case {i} ({params[i]}) diverged from generate()"
    assert any(expected[i] != plain[i] for i in range(1, len(prompts), 4)), (
        "repetition_penalty changed no output: the comparison would not see it ignored"
    )
    for i in range(2, len(prompts), 4):
        assert (outs[i].finish_reason, outs[i].stop_reason) == ("stop", expected[i][-1])
    assert engine.stats().kv_blocks_used == 0


def test_min_tokens_also_holds_back_eos_and_stop_strings(llm: LLM) -> None:
    prompt = _prompts(1)[0]
    free = llm.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = free.text[1:4]
    assert stop
    cut = llm.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 4
    held = llm.generate(
        [prompt],
        SamplingParams(max_tokens=10, temperature=0, stop=[stop], min_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= 6 and held.token_ids[:6] == free.token_ids[:6]
    # eos itself: masked until min_tokens, whatever ignore_eos says after
    eos = min(llm.engine.eos_token_ids)
    seq = _sequence(SamplingParams(max_tokens=10, min_tokens=2, temperature=0), [5, 6, 7])
    logits = torch.zeros(1, llm.engine.vocab_size)
    logits[0, eos] = 100.0
    tokens, _ = llm.engine.sampler(logits, [seq])
    assert tokens[0] != eos
    seq.token_ids += [8, 9]  # two output tokens: min_tokens reached
    assert llm.engine.sampler(logits, [seq])[0] == [eos]


def test_min_p_is_transformers_filter() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    values = [0.0, 0.05, 0.3, 1.0]
    ours = min_p_filter(logits, torch.tensor(values))
    for row, value in enumerate(values):
        theirs = (
            MinPLogitsWarper(value)(None, logits[row : row + 1].clone())
            if value
            else logits[row : row + 1]
        )
        assert torch.equal(ours[row], theirs[0]), value
    assert (ours[3] > float("-inf")).sum() == 1  # min_p 1: the likeliest token alone
    assert torch.equal(ours.argmax(-1), logits.argmax(-1))


def test_repetition_penalty_is_transformers_processor() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(300)
    ids = [5, 17, 5, 299, 42]
    ours = logits.clone()
    repetition_penalty_(ours, ids, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits[None].clone())
    assert torch.equal(ours, theirs[0])


def test_min_p_one_samples_the_greedy_tokens(llm: LLM) -> None:
    """With only the likeliest token left, sampling at any temperature is greedy decoding."""
    prompts = _prompts(3)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    hot = SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True, min_p=1.0)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, hot, use_tqdm=False)]
    assert got == want
    plain_hot = SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True)
    assert [
        o.outputs[0].token_ids for o in llm.generate(prompts, plain_hot, use_tqdm=False)
    ] != want


def test_regex_and_choice_constrain_the_output(llm: LLM) -> None:
    prompts = _prompts(6)
    choices = ["yes", "no", "a.b (c)", "x|y\n-z"]
    params = [
        SamplingParams(max_tokens=16, temperature=t, seed=i, choice=choices)
        for i, t in enumerate((0.0, 1.0, 1.0))
    ] + [
        SamplingParams(max_tokens=16, temperature=t, seed=i, regex=r"[0-9]{2,4}-[a-c]+")
        for i, t in enumerate((0.0, 1.0, 1.0))
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for out in outs[:3]:
        assert out.text in choices and out.finish_reason == "stop", out
    for out in outs[3:]:
        # a match may stop or run on to max_tokens within the pattern
        assert re.fullmatch(r"[0-9]{2,4}-[a-c]+", out.text) or (
            out.finish_reason == "length" and re.fullmatch(r"[0-9]{2,4}(-[a-c]*)?", out.text)
        ), out
    with pytest.raises(ValueError, match="at most one of json_schema, regex and choice"):
        SamplingParams(regex="a", choice=["a"])


def _sequence(params: SamplingParams, tokens: list[int], prompt_len: int = 3) -> Sequence:
    request = Request("r", tokens[:prompt_len], params, RequestMetrics(arrival_time=0.0))
    return Sequence(request, 0, list(tokens), 100, None)


def test_skip_special_tokens_decides_the_text(llm: LLM) -> None:
    engine = llm.engine
    special = min(engine.eos_token_ids)
    words = engine.tokenizer.encode(" hello world", add_special_tokens=False)
    tokens = [5, 6, 7, *words[:1], special, *words[1:]]
    texts = {}
    for skip in (True, False):
        seq = _sequence(SamplingParams(skip_special_tokens=skip), tokens)
        seq.finish_reason = "length"
        engine._final_text(seq)
        texts[skip] = seq.text
    marker = engine.tokenizer.convert_ids_to_tokens(special)
    assert marker not in texts[True] and marker in texts[False]
    assert texts[True] == engine.tokenizer.decode(tokens[3:], skip_special_tokens=True)
