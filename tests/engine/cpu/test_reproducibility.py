"""The same request gives the same bits (docs/engine.md, "Reproducible"): which GEMM a linear
layer runs is decided once per machine and recorded, never re-timed at a start
(engine/cpu/linear.py), so the float bits of every step, and with them greedy near-ties, do not
depend on how loaded the machine was when the engine started; and where the compiled GEMM
runs, nor on what else the batch holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.llms.demo import build
from engine import Engine, SamplingParams
from engine.cpu import linear


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private record, and no verdict of this process's earlier engines."""
    path = tmp_path / "gemm-choices.json"
    monkeypatch.setattr(linear, "machine_record", lambda name: path)
    monkeypatch.setattr(linear, "_VERDICTS", {})
    return path


def _never_timed(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise AssertionError("a shape this machine recorded was timed again")


def test_a_shape_is_timed_once_per_machine(record: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int, bool]] = []

    def fake(layer: torch.nn.Linear, rows: int, repeats: int, compiled: bool = True) -> str:
        timed.append((layer.out_features, rows, compiled))
        return "onednn"

    monkeypatch.setattr(linear, "_time_packing", fake)
    layer = torch.nn.Linear(8, 24)
    assert linear.recorded_packing(layer, 32) == "onednn"
    saved = json.loads(record.read_text())["choices"]
    assert saved == {"24x8:float32:32": "onednn"}
    # A restart: nothing in the process remembers, the record answers.
    monkeypatch.setattr(linear, "_VERDICTS", {})
    monkeypatch.setattr(linear, "_time_packing", _never_timed)
    assert linear.recorded_packing(torch.nn.Linear(8, 24), 32) == "onednn"
    assert timed == [(24, 32, True)]
    # Without the compiled kernels the question is another one, timed and recorded apart.
    monkeypatch.setattr(linear, "_time_packing", fake)
    assert linear.recorded_packing(layer, 32, compiled=False) == "onednn"
    assert timed[-1] == (24, 32, False)
    assert "24x8:float32:32:torch" in json.loads(record.read_text())["choices"]


def test_a_record_that_cannot_be_read_is_timed_again(
    record: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(linear, "_time_packing", lambda *a, **k: None)
    for text in ("{not json", '{"choices": {"24x8:float32:32": "cublas"}}', "[]"):
        record.write_text(text)
        monkeypatch.setattr(linear, "_VERDICTS", {})
        assert linear.recorded_packing(torch.nn.Linear(8, 24), 32) is None
        assert json.loads(record.read_text())["choices"] == {"24x8:float32:32": "plain"}


def test_a_recorded_packing_no_longer_at_hand_is_timed_again(
    record: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record.write_text(json.dumps({"choices": {"24x8:float32:32": "batchd"}}))
    monkeypatch.setattr(linear, "kinds_for", lambda dtype, compiled=True: ("onednn",))
    monkeypatch.setattr(linear, "_time_packing", lambda *a, **k: "onednn")
    assert linear.recorded_packing(torch.nn.Linear(8, 24), 32) == "onednn"


def test_a_verdict_of_this_process_no_longer_at_hand_is_timed_again(
    record: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict this process timed while the compiled GEMM was loaded is not handed out once
    it is not (a test that swaps the library for another build): it is timed again."""
    layer = torch.nn.Linear(8, 24)
    linear._VERDICTS[(24, 8, torch.float32, 32)] = "batchd"
    monkeypatch.setattr(linear, "kinds_for", lambda dtype, compiled=True: ("onednn",))
    monkeypatch.setattr(linear, "_time_packing", lambda *a, **k: "onednn")
    assert linear.packing_for(layer, 32) == "onednn"


def test_a_forced_packing(record: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_time_packing", _never_timed)
    layer = torch.nn.Linear(8, 24)
    assert linear.choose_packing(layer, 32, "plain", compiled=True) is None
    assert linear.choose_packing(layer, 32, "onednn", compiled=True) == "onednn"
    ours = "batchd" in linear.kinds_for(torch.bfloat16)
    want = "batchd" if ours else "onednn"
    assert linear.choose_packing(layer.bfloat16(), 32, "auto", compiled=True) == want
    with pytest.raises(ValueError, match="cpu_gemm 'batchd' is not at hand .* cpu_kernels off"):
        linear.choose_packing(torch.nn.Linear(8, 24), 32, "batchd", compiled=False)
    with pytest.raises(ValueError, match="cpu_gemm 'mkl' is not at hand for torch.bfloat16"):
        linear.choose_packing(layer, 32, "mkl", compiled=True)
    assert not record.exists()  # nothing timed, nothing recorded


def test_kernels_off_turns_off_the_compiled_gemm(record: Path) -> None:
    """``cpu_kernels`` False: no compiled kernel at all, the GEMM included."""
    engine = Engine(str(build("llama-tiny")), dtype="float32", cpu_kernels=False)
    assert "batchd" not in _kinds(engine)
    assert engine.runner.lean is None
    assert engine.runner.backend.kernel is None and engine.runner.backend.prefill is None


# -- two starts, the second under load ------------------------------------------------------------

PROMPTS = [[(7 * i + 3 * j) % 300 + 20 for j in range(5 + 9 * i)] for i in range(8)]
PARAMS = [
    SamplingParams(
        max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    for i in range(8)
]


def _run(engine: Engine) -> dict[str, list]:
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0]
                done[out.request_id] = [completion.token_ids, completion.logprobs]
    return done


def _kinds(engine: Engine) -> list[str]:
    return [
        getattr(m, "kind", "plain")
        for m in [*engine.runner.base.modules(), engine.runner.lm_head]
        if isinstance(m, linear.PackedLinear | torch.nn.Linear)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_starts_under_different_load_give_the_same_bits(
    record: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The first start on a machine times and records; the second, beside two busy processes
    (the threads it takes may differ), reads the record: the same packings, and a mixed batch
    gives the same tokens and log-probabilities to the bit."""
    path = str(build("llama-tiny"))
    first = Engine(path, dtype=dtype)
    want = _run(first)
    want_kinds = _kinds(first)
    del first
    monkeypatch.setattr(linear, "_VERDICTS", {})  # a new process remembers nothing
    monkeypatch.setattr(linear, "_time_packing", _never_timed)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        second = Engine(path, dtype=dtype)
        got = _run(second)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert _kinds(second) == want_kinds
    assert got == want


# -- alone or in a full batch ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_line_gives_the_same_bits_alone_and_in_a_full_batch(record: Path, dtype: str) -> None:
    """Where the compiled GEMM runs (every linear layer's rows summed in one order whatever
    the step holds; each sequence's attention its own), a request's tokens and
    log-probabilities are the same to the bit alone and among a full running batch."""
    if "batchd" not in linear.kinds_for(getattr(torch, dtype)):
        pytest.skip(f"no compiled {dtype} GEMM here: oneDNN's rows depend on the step")
    path = str(build("llama-tiny"))
    engine = Engine(path, dtype=dtype, max_num_seqs=8)
    assert set(_kinds(engine)) == {"batchd"}  # auto takes it where it is built
    target = 3
    alone = Engine(path, dtype=dtype, max_num_seqs=8)
    alone.add_request("alone", PROMPTS[target], PARAMS[target])
    want = None
    while alone.has_unfinished_requests():
        for out in alone.step():
            if out.finished:
                want = [out.outputs[0].token_ids, out.outputs[0].logprobs]
    crowded = _run(engine)
    assert crowded[f"r{target}"] == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_cut_into_other_chunks_gives_the_same_bits(record: Path, dtype: str) -> None:
    """The step's token budget cuts a long prompt where the others in the step leave room:
    alone into 64 + 64 + 22 tokens, behind two other prompts elsewhere (a first chunk of a
    few tokens among them). Every chunk attends in the prefill kernel, whose sums run over
    blocks of keys at fixed positions: the same bits either way."""
    if "batchd" not in linear.kinds_for(getattr(torch, dtype)):
        pytest.skip(f"no compiled {dtype} GEMM here: oneDNN's rows depend on the step")
    path = str(build("llama-tiny"))
    target = [(11 * j) % 300 + 20 for j in range(150)]
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    runs = []
    for others in ([], [PROMPTS[4][:45], PROMPTS[5][:13]]):
        engine = Engine(path, dtype=dtype, max_num_batched_tokens=64, enable_prefix_caching=False)
        if engine.runner.backend.prefill is None:
            pytest.skip("no prefill kernel here")
        for i, prompt in enumerate(others):
            engine.add_request(f"other{i}", prompt, PARAMS[i])
        engine.add_request("target", target, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == "target":
                    runs.append([out.outputs[0].token_ids, out.outputs[0].logprobs])
    assert runs[0] == runs[1]
