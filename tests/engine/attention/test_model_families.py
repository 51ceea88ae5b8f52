"""Model families with attention features of their own — Mistral's sliding window, Qwen2 with
``use_sliding_window`` (global and windowed layers), Gemma-2 (alternating local/global layers,
attention-logit and final-logit soft-capping) — give exactly ``model.generate()``'s greedy
tokens, one request at a time, on every attention backend that runs on CPU, under preemption
and chunked prefill. The window (32) is shorter than most prompts, so a backend that ignored it
(or the soft-cap) would produce other text: ``test_the_features_change_the_text`` proves it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from core.llms.demo import FAMILY_MODELS, build
from engine import Engine, SamplingParams
from engine.attention.paged import check_kwargs, paged_attention

PROMPT_LENGTHS = [20, 45, 70, 100, 33, 130]
MAX_TOKENS = [16, 24, 8, 12, 20, 6]
BACKENDS = ["sdpa", "flex"]
# Engine options per regime; the flex backend on CPU attends over the whole pool, so pools are small.
REGIMES = {
    "default": dict(num_kv_blocks=64),
    "preemption": dict(num_kv_blocks=20, max_num_seqs=6),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False),
}


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _generate(
    path: str | Path,
    prompts: list[list[int]],
    dtype: torch.dtype = torch.float32,
    scores: bool = False,
    **overrides: object,
) -> list:
    """Greedy continuations by transformers (eager attention), one request at a time, never
    stopping at eos. ``overrides`` change the config (to switch a feature off)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", **overrides
    ).eval()
    config = model.generation_config
    config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                generation_config=config,
                return_dict_in_generate=True,
                output_scores=scores,
            )
            tokens = gen.sequences[0, len(prompt) :].tolist()
            out.append((tokens, [s[0].float() for s in gen.scores]) if scores else tokens)
    return out


def _engine_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 2_000
    assert engine.stats().kv_blocks_used == 0
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def family(request: pytest.FixtureRequest) -> dict:
    path = build(request.param)
    prompts = _prompts(7)
    return {
        "name": request.param,
        "path": path,
        "prompts": prompts,
        "reference": _generate(path, prompts),
    }


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_generate(family: dict, backend: str, regime: str) -> None:
    engine = Engine(str(family["path"]), attention_backend=backend, **REGIMES[regime])
    assert engine.runner.backend_name == backend
    got = _engine_tokens(engine, family["prompts"])
    for i, (g, want) in enumerate(zip(got, family["reference"], strict=True)):
        assert g == want, (
            f"{family['name']} {backend} {regime}: request {i} ({PROMPT_LENGTHS[i]} tokens) diverged"
        )
    stats = engine.stats()
    if regime == "preemption":
        assert stats.num_preemptions > 0
    if regime == "chunked":
        assert stats.num_chunked_prefills > 0


def test_the_features_change_the_text(family: dict) -> None:
    """Without its window (or soft-cap) the model writes other tokens on these prompts, so the
    equality above would catch a backend that ignored them."""
    prompts, reference = family["prompts"], family["reference"]
    off = [{"sliding_window": 4096}]
    if family["name"].startswith("gemma2"):
        off.append({"attn_logit_softcapping": None})
    for overrides in off:
        changed = _generate(family["path"], prompts, **overrides)
        assert changed != reference, (
            f"{family['name']}: {overrides} changes nothing on the test prompts"
        )


# -- bf16 -------------------------------------------------------------------------------------

# Two tokens are a near-tie when generate()'s top-2 logits at that step differ by less than
# NEAR_TIE_GAP (bf16 keeps 8 significant bits: at logits of magnitude 4-8 one step is 1/32-1/16,
# and the engine's packed step sums in another order than generate()).
NEAR_TIE_GAP = 0.125


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_agrees_except_at_near_ties(backend: str) -> None:
    path = build("gemma2-tiny")
    prompts = _prompts(11)
    reference = _generate(path, prompts, dtype=torch.bfloat16, scores=True)
    engine = Engine(
        str(path),
        attention_backend=backend,
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_batched_tokens=48,
    )
    got = _engine_tokens(engine, prompts)
    exact = 0
    for i, (g, (want, scores)) in enumerate(zip(got, reference, strict=True)):
        if g == want:
            exact += 1
            continue
        t = next(k for k, (a, b) in enumerate(zip(g, want, strict=True)) if a != b)
        top2 = scores[t].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert g[t] in top2.indices.tolist(), (
            f"request {i}: token {t} is not generate()'s first or second choice"
        )
        assert gap < NEAR_TIE_GAP, (
            f"request {i}: diverged at token {t} where the top-2 gap is {gap:.4f}"
        )
    assert exact >= len(prompts) // 2, f"only {exact} of {len(prompts)} bf16 requests agree in full"


# -- refusing what no backend implements --------------------------------------------------------


def test_unknown_attention_kwarg_is_refused_by_name() -> None:
    check_kwargs({"position_ids": torch.zeros(1), "output_attentions": False, "s_aux": None})
    with pytest.raises(ValueError, match="'s_aux'"):
        check_kwargs({"s_aux": torch.zeros(4)})
    with pytest.raises(ValueError, match="is_causal=False"):
        check_kwargs({"is_causal": False})
    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="'attention_sinks'"):
        layer = torch.nn.Module()
        layer.layer_idx = 0
        from engine.attention.paged import AttentionContext
        from engine.attention.sdpa import SdpaBackend

        cache = [torch.zeros(1, 4, 2, 8)]
        ctx = AttentionContext(cache, cache, torch.zeros(1, dtype=torch.long), SdpaBackend())
        paged_attention(layer, q, q, q, None, batchd_ctx=ctx, attention_sinks=torch.ones(2))


def test_a_model_with_an_unsupported_attention_feature_is_refused_at_load(tmp_path: Path) -> None:
    src = build("llama-tiny")
    dst = tmp_path / "chunked-llama"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["attention_chunk_size"] = 8
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention_chunk_size"):
        Engine(str(dst))


def test_backend_is_chosen_by_device_and_validated() -> None:
    from engine.attention.paged import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("auto", torch.device("cuda")) == "flex"
    assert resolve_backend("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(str(build("llama-tiny")), attention_backend="paged")
