"""LoRA adapters end to end: the whole service (API, control and model workers, Postgres, Redis)
serving the tiny demo model and adapters of it made here with peft's format and seeded random
weights (:mod:`testkit.builders.lora`). One batch holds lines for two adapters and the base, runs as
one batch on the base's engine, and each line's text is what the offline engine gives with the
same adapter; an adapter whose directory was missing at start, or whose weights went later,
fails its own lines, naming it, and nothing else; ``/v1/models`` lists each adapter with its
base as ``parent`` through the unmodified ``openai`` SDK."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.builders.lines import MODEL, completion_line, jsonl

pytestmark = [pytest.mark.services, pytest.mark.slow]

# The adapters live where the module's stack can be told of them before they exist: its
# environment is read when the stack starts, after the autouse fixture below made them.
ROOT = Path(tempfile.gettempdir()) / f"batchd-lora-e2e-{os.getpid()}"
ADAPTERS = {"bot-a": 11, "bot-b": 22, "bot-late": 33}  # name -> seed
MISSING = "bot-missing"
WIDE = "bot-wide"  # of rank 72, over the engine's max_lora_rank (default 64)
STACK_ENV = {
    "BATCHD_MODELS": json.dumps(
        {
            MODEL: "demo:llama-tiny",
            **{name: f"lora:{MODEL}?path={ROOT / name}" for name in [*ADAPTERS, WIDE]},
            MISSING: f"lora:{MODEL}?path={ROOT / 'never-written'}",
        }
    ),
}
PROMPTS = [f"The quick brown fox {i} jumps over" for i in range(3)]
MAX_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def adapters() -> Iterator[dict[str, Path]]:
    from core.llms.demo import build
    from testkit.builders.lora import make_adapter

    base = build("llama-tiny")
    ROOT.mkdir(parents=True, exist_ok=True)
    try:
        make_adapter(base, ROOT / WIDE, rank=72, target_modules=["q_proj"], seed=44)
        yield {
            name: make_adapter(
                base, ROOT / name, rank=8, target_modules=["q_proj", "v_proj"], seed=seed
            )
            for name, seed in ADAPTERS.items()
        }
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Path]) -> dict[str | None, list[str]]:
    """Each prompt's greedy text by the offline engine, per adapter (None: the base)."""
    from core.llms.demo import build
    from engine import LLM, SamplingParams

    llm = LLM(  # as the stack's engine
        str(build("llama-tiny")),
        dtype="float32",
        lora_adapters={name: str(path) for name, path in adapters.items()},
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    prompts: list[str | list[int]] = list(PROMPTS)
    return {
        lora: [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False, lora=lora)]
        for lora in (None, "bot-a", "bot-b")
    }


def _run(stack: Any, lines: list[dict[str, Any]]) -> tuple[Any, list[dict], list[dict]]:
    client = stack.client
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{batch}\n{stack.log('model')[-3000:]}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)

    def read(file_id: str | None) -> list[dict[str, Any]]:
        text = client.files.content(file_id).text if file_id else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    return batch, read(batch.output_file_id), read(batch.error_file_id)


def test_adapters_and_their_base_share_one_batch_and_match_the_engine(
    stack: Any, expected: dict[str | None, list[str]]
) -> None:
    names: list[str | None] = ["bot-a", None, "bot-b"]
    lines = [
        completion_line(f"{name or 'base'}-{i}", prompt, MAX_TOKENS, model=name or MODEL)
        for i, prompt in enumerate(PROMPTS)
        for name in names
    ]
    batch, out, errors = _run(stack, lines)
    assert batch.status == "completed", batch
    assert errors == []
    assert (batch.request_counts.total, batch.request_counts.completed) == (9, 9)
    got = {r["custom_id"]: r["response"]["body"] for r in out}
    for i in range(len(PROMPTS)):
        for name in names:
            body = got[f"{name or 'base'}-{i}"]
            assert body["model"] == (name or MODEL)
            assert body["choices"][0]["text"] == expected[name][i], (name, i)
            # counted by the base's tokenizer
            assert body["usage"]["prompt_tokens"] == got[f"base-{i}"]["usage"]["prompt_tokens"]
    # The adapters change what the model says, each its own way.
    assert expected["bot-a"] != expected[None] and expected["bot-b"] != expected[None]
    assert expected["bot-a"] != expected["bot-b"]
    # One engine ran them: the model worker's log names one batch's shards, none per adapter.
    assert f"adapter bot-a ready on model {MODEL}" in stack.log("model")


def test_an_adapter_that_cannot_run_fails_its_own_lines(
    stack: Any, adapters: dict[str, Path], expected: dict[str | None, list[str]]
) -> None:
    # Registered at start, its weights gone before any line made it resident.
    (adapters["bot-late"] / "adapter_model.safetensors").unlink()
    lines = [
        completion_line("a", PROMPTS[0], MAX_TOKENS, model="bot-a"),
        completion_line("missing", PROMPTS[0], MAX_TOKENS, model=MISSING),
        completion_line("late", PROMPTS[0], MAX_TOKENS, model="bot-late"),
        completion_line("wide", PROMPTS[0], MAX_TOKENS, model=WIDE),
        completion_line("base", PROMPTS[0], MAX_TOKENS),
        # over the base's context (1,024 tokens), as its tokenizer counts
        completion_line("too-long", "the cat " * 700, MAX_TOKENS, model="bot-b"),
    ]
    batch, out, errors = _run(stack, lines)
    assert batch.status == "completed", batch
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in out} == {
        "a": expected["bot-a"][0],
        "base": expected[None][0],
    }
    by_id = {r["custom_id"]: r["response"] for r in errors}
    assert set(by_id) == {"missing", "late", "wide", "too-long"}
    assert by_id["too-long"]["body"]["error"]["code"] == "context_length_exceeded"
    for custom_id, adapter, reason in [  # each its own error, naming the adapter and why
        ("missing", MISSING, "never-written does not exist"),
        ("late", "bot-late", "adapter_model.safetensors are missing or unreadable"),
        ("wide", WIDE, "r 72 exceeds max_lora_rank 64"),  # the engine's reason
    ]:
        assert by_id[custom_id]["status_code"] == 400
        error = by_id[custom_id]["body"]["error"]
        assert (error["code"], error["param"]) == ("adapter_unavailable", "body.model")
        assert f"The adapter {adapter!r} (body.model) cannot run on {MODEL!r}" in error["message"]
        assert reason in error["message"]
    # The worker said so at start, naming the entry.
    for adapter in (MISSING, WIDE):
        assert f"adapter {adapter!r} of model {MODEL!r} is refused" in stack.log("model")


def test_a_model_that_is_not_served_fails_validation(stack: Any) -> None:
    lines = [
        completion_line("a", PROMPTS[0], MAX_TOKENS, model="bot-a"),
        completion_line("x", PROMPTS[0], MAX_TOKENS, model="bot-unknown"),
    ]
    batch, _, _ = _run(stack, lines)
    assert batch.status == "failed"
    (error,) = batch.errors.data
    assert (error.code, error.line, error.param) == ("model_not_found", 2, "body.model")
    assert "bot-unknown" in error.message


def test_models_lists_each_adapter_with_its_base_as_parent(stack: Any) -> None:
    listed = {m.id: m for m in stack.client.models.list()}
    assert set(listed) == {MODEL, *ADAPTERS, MISSING, WIDE}
    base = listed[MODEL]
    assert (base.owned_by, base.parent, base.root) == ("batchd", None, MODEL)
    for name in ADAPTERS:
        model = listed[name]
        assert model.object == "model" and model.owned_by == "batchd"
        assert model.parent == MODEL
        # the adapter's served name, never the directory it was loaded from
        assert model.root == name and str(ROOT) not in model.model_dump_json()
        assert model.endpoints == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    assert stack.client.models.retrieve("bot-b").parent == MODEL
