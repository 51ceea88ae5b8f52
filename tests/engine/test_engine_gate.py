"""The tests' engine gate (testkit.engine_gate) holds what the e2e tests rely on it to
hold: a marked request cannot finish while its gate is closed, an abort or opening the gate
releases the engine, and a capped engine holds for good after its quota."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from core.llms.demo import build
from engine import Engine, EngineHost, SamplingParams
from testkit import engine_gate

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build("llama-tiny")


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_a_marked_request_holds_the_engine_until_its_gate_opens(model_dir: Path) -> None:
    engine = Engine(str(model_dir), max_num_seqs=2)
    opened = threading.Event()
    engine_gate.install(engine, lambda name: name == "g1" and not opened.is_set())
    with EngineHost(engine) as host:
        free = host.submit(_prompt(engine, "a free request"), PARAMS)
        assert free.result(timeout=60).outputs[0].finish_reason == "length"
        held = host.submit(_prompt(engine, f"a held request {engine_gate.marker('g1')}"), PARAMS)
        other = host.submit(_prompt(engine, "admitted beside it"), PARAMS)
        time.sleep(0.5)
        assert not held.done() and not other.done()  # the whole engine is held
        steps = engine.stats().num_steps
        time.sleep(0.2)
        assert engine.stats().num_steps == steps  # held steps compute nothing
        opened.set()
        assert held.result(timeout=60).outputs[0].finish_reason == "length"
        assert other.result(timeout=60).outputs[0].finish_reason == "length"


def test_an_abort_releases_a_held_engine(model_dir: Path) -> None:
    engine = Engine(str(model_dir), max_num_seqs=2)
    engine_gate.install(engine, lambda name: True)  # closed for good
    with EngineHost(engine) as host:
        held = host.submit(
            _prompt(engine, f"held {engine_gate.marker('g2')}"), PARAMS, request_id="held"
        )
        other = host.submit(_prompt(engine, "beside it"), PARAMS)
        time.sleep(0.3)
        assert not other.done()
        assert host.abort("held")
        assert held.result(timeout=30).outputs[0].finish_reason == "abort"
        assert other.result(timeout=60).outputs[0].finish_reason == "length"


def test_a_capped_engine_holds_after_its_quota(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="engine_gate")
    engine = Engine(str(model_dir), max_num_seqs=1)
    engine_gate.install(engine, lambda name: False, after=2)
    host = EngineHost(engine).start()
    futures = [host.submit(_prompt(engine, f"request {i}"), PARAMS) for i in range(4)]
    futures[1].result(timeout=60)
    time.sleep(0.5)
    assert [f.done() for f in futures] == [True, True, False, False]
    # What a test waits for before it kills the worker: a request that cannot finish.
    assert "engine gate after 2 holding requests in flight" in caplog.messages
    host.shutdown(wait=True, abort_pending=True, timeout=30)  # the aborts still get through
    assert [f.result(timeout=0).outputs[0].finish_reason for f in futures[2:]] == ["abort"] * 2
