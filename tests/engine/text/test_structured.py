"""Structured output on the random demo model, which left alone emits gibberish: every output
that completes is JSON valid against its schema, and unconstrained requests sharing the steps
are unchanged."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from engine import LLM, Engine, RequestError, SamplingParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 1,
                "maxItems": 4,
            },
            "kind": {"type": "string", "enum": ["a", "b"]},
        },
        "required": ["ok", "scores", "kind"],
        "additionalProperties": False,
    },
    {"type": "object"},  # json_object mode
]


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 2048) for _ in range(rng.randint(4, 48))]


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_200_mixed_schema_requests_all_valid_and_unconstrained_unchanged(llm: LLM) -> None:
    rng = random.Random(7)
    prompts, params, schemas = [], [], []
    for i in range(200):
        prompts.append(_prompt(rng))
        if i % 5 == 4:  # one in five unconstrained, greedy
            schemas.append(None)
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            continue
        schema = SCHEMAS[i % len(SCHEMAS)]
        schemas.append(schema)
        sampled = i % 3 == 0
        params.append(
            SamplingParams(
                max_tokens=100,
                temperature=0.8 if sampled else 0.0,
                seed=i if sampled else None,
                json_schema=schema,
            )
        )
    outs = llm.generate(prompts, params, use_tqdm=False)
    completed = 0
    for out, schema in zip(outs, schemas, strict=True):
        c = out.outputs[0]
        if schema is None:
            continue
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            _check(c.text, schema)
            completed += 1
    assert completed >= 110, f"only {completed} of 160 constrained requests completed"

    free = [i for i, s in enumerate(schemas) if s is None]
    alone = llm.generate([prompts[i] for i in free], [params[i] for i in free], use_tqdm=False)
    for i, out in zip(free, alone, strict=True):
        assert outs[i].outputs[0].token_ids == out.outputs[0].token_ids


def test_json_object_mode_and_n_completions(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=120, temperature=1.0, seed=3, n=4, json_schema={"type": "object"}
    )
    out = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.startswith("{")


def test_structured_output_is_the_same_under_preemption(path: str) -> None:
    rng = random.Random(11)
    prompts = [_prompt(rng) for _ in range(12)]
    params = SamplingParams(max_tokens=80, temperature=0.0, json_schema=SCHEMAS[1])
    roomy = LLM(path).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, num_kv_blocks=24, block_size=8, max_num_seqs=12)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    for a, b in zip(roomy, squeezed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_length_before_the_json_closes(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, json_schema=SCHEMAS[1])
    c = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length"
    assert c.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_a_schema_that_cannot_be_enforced_is_refused(path: str) -> None:
    engine = Engine(path)
    with pytest.raises(RequestError) as info:
        engine.add_request(
            "r", [5, 6], SamplingParams(json_schema={"type": "array", "uniqueItems": True})
        )
    assert info.value.code == "invalid_json_schema"
    assert "uniqueItems" in str(info.value)


def test_mask_work_is_counted(llm: LLM) -> None:
    before = llm.engine.stats().num_grammar_masks
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, json_schema=SCHEMAS[0]), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_grammar_masks > before
    assert stats.total_grammar_mask_time_s > 0
