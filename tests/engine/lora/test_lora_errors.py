"""Adapters the engine refuses, each with an ``AdapterError`` naming the adapter, the field and
the value or limit; and an adapter named by ``LLM.generate`` and ``EngineHost.submit``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.llms.demo import build
from engine import LLM, Engine, SamplingParams
from engine.host.host import EngineHost
from engine.lora import AdapterError
from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from testkit.builders.lora import make_adapter


@pytest.fixture(scope="module")
def path() -> str:
    return str(build("llama-tiny"))


@pytest.fixture(scope="module")
def adapter(path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapter") / "qv4"
    return make_adapter(path, out, rank=4, target_modules=["q_proj", "v_proj"], seed=1)


@pytest.fixture(scope="module")
def engine(path: str, adapter: Path) -> Engine:
    return Engine(path, lora_adapters={"qv4": str(adapter)}, num_kv_blocks=64, max_lora_rank=8)


def _variant(adapter: Path, tmp_path: Path, **config: object) -> Path:
    """A copy of ``adapter`` with ``config`` set in its adapter_config.json."""
    out = tmp_path / "variant"
    shutil.copytree(adapter, out)
    data = json.loads((out / CONFIG_FILE).read_text())
    data.update(config)
    (out / CONFIG_FILE).write_text(json.dumps(data))
    return out


def test_rank_above_max_lora_rank(path: str, engine: Engine, tmp_path: Path) -> None:
    big = make_adapter(path, tmp_path / "r16", rank=16, target_modules=["q_proj"], seed=2)
    with pytest.raises(AdapterError, match=r"adapter 'r16': r 16 exceeds max_lora_rank 8"):
        engine.add_lora("r16", str(big))
    with pytest.raises(AdapterError, match=r"adapter 'r16': r 16 exceeds max_lora_rank 4"):
        Engine(path, lora_adapters={"r16": str(big)}, max_lora_rank=4, num_kv_blocks=8)


def test_target_module_the_base_lacks(engine: Engine, adapter: Path, tmp_path: Path) -> None:
    odd = _variant(adapter, tmp_path, target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match=r"adapter 'odd': target_modules 'c_attn' is not"):
        engine.add_lora("odd", str(odd))
    # a tensor for a module the base does not have
    weights = load_file(str(adapter / WEIGHTS_FILE))
    extra = tmp_path / "extra"
    shutil.copytree(adapter, extra)
    prefix = "base_model.model.model.layers.9.self_attn.q_proj"
    weights[prefix + ".lora_A.weight"] = torch.zeros(4, 64)
    weights[prefix + ".lora_B.weight"] = torch.zeros(64, 4)
    save_file(weights, str(extra / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match=r"'model.layers.9.self_attn.q_proj' is not a linear"):
        engine.add_lora("extra", str(extra))


def test_shapes_of_another_base(engine: Engine, adapter: Path, tmp_path: Path) -> None:
    """An adapter trained on a model of another hidden size."""
    weights = load_file(str(adapter / WEIGHTS_FILE))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    weights[key] = torch.zeros(4, 96)
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    save_file(weights, str(other / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match=r"adapter 'other': module .*q_proj' has shape lora_A"):
        engine.add_lora("other", str(other))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("bias", "all"),
        ("modules_to_save", ["lm_head"]),
        ("peft_type", "IA3"),
    ],
)
def test_unsupported_features(
    engine: Engine, adapter: Path, tmp_path: Path, field: str, value: object
) -> None:
    variant = _variant(adapter, tmp_path, **{field: value})
    with pytest.raises(AdapterError, match=rf"adapter 'v': {field} .* is not supported"):
        engine.add_lora("v", str(variant))
    assert "v" not in engine.runner.loras.specs


def test_not_an_adapter_directory(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"adapter 'none': no adapter_config.json"):
        engine.add_lora("none", str(tmp_path))


def test_a_name_registers_once(engine: Engine, adapter: Path) -> None:
    with pytest.raises(AdapterError, match=r"adapter 'qv4' is already registered"):
        engine.add_lora("qv4", str(adapter))


def test_unknown_adapter(engine: Engine, path: str) -> None:
    with pytest.raises(AdapterError, match=r"unknown LoRA adapter 'nope'.*registered.*'qv4'"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2), lora="nope")
    assert not engine.has_unfinished_requests()
    llm = LLM(path, num_kv_blocks=8)
    with pytest.raises(
        AdapterError, match=r"unknown LoRA adapter 'nope'; registered adapters: none"
    ):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora="nope")


def test_config_bounds(path: str) -> None:
    for field in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=rf"{field} must be an integer >= 1, got 0"):
            Engine(path, **{field: 0})
    with pytest.raises(ValueError, match="lora_adapters must map adapter names to directories"):
        Engine(path, lora_adapters={"a": 3})


def test_llm_and_host_take_an_adapter(engine: Engine, path: str, adapter: Path) -> None:
    """``LLM.generate(lora=)`` and ``EngineHost.submit(lora=)`` give the engine's own output
    for that adapter; an unknown name fails the host's future with ``AdapterError``."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]
    engine.add_request("direct", prompt, params, lora="qv4")
    engine.add_request("plain", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert outs["direct"] != outs["plain"]

    llm = LLM(path, lora_adapters={"qv4": str(adapter)}, num_kv_blocks=64)
    (out,) = llm.generate([prompt], params, use_tqdm=False, lora="qv4")
    assert out.outputs[0].token_ids == outs["direct"]

    host_engine = Engine(path, lora_adapters={"qv4": str(adapter)}, num_kv_blocks=64)
    with EngineHost(host_engine) as host:
        got = host.submit(prompt, params, lora="qv4").result(timeout=120)
        base = host.submit(prompt, params).result(timeout=120)
        unknown = host.submit(prompt, params, lora="nope")
        with pytest.raises(AdapterError, match="unknown LoRA adapter 'nope'"):
            unknown.result(timeout=120)
    assert got.outputs[0].token_ids == outs["direct"]
    assert base.outputs[0].token_ids == outs["plain"]
