"""A LoRA adapter as peft saves it, read without peft: ``adapter_config.json`` and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` for each adapted linear layer).

:func:`read_adapter` checks an adapter against the base model at registration, reading only
the tensors' shapes: its rank against ``max_lora_rank``, each target against the base's linear
layers, each shape against the layer's, and the peft features the engine does not apply
(DoRA, biases, ``modules_to_save`` ...). Every refusal is an :class:`AdapterError` naming the
adapter, the field and the value or limit. :func:`load_weights` reads the tensors when the
adapter is made resident."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"

# peft options the engine does not apply, with the value each must have (an absent key is fine).
_UNSUPPORTED: dict[str, object] = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "use_qalora": False,
}
_EMPTY = ("modules_to_save", "alpha_pattern", "target_parameters", "trainable_token_indices")


class AdapterError(ValueError):
    """An adapter the engine refuses: unknown, or one that does not fit the base model or the
    engine's bounds. The message names the adapter, the field and the value or limit."""


@dataclass(frozen=True, slots=True)
class ModuleLora:
    """One adapted linear layer: its path in the causal LM (``model.layers.0.self_attn.q_proj``),
    its rank and scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA)."""

    path: str
    rank: int
    scale: float
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A registered adapter: where it lives and what it adapts (its weights stay on disk)."""

    name: str
    directory: Path
    rank: int
    modules: dict[str, ModuleLora]

    def num_params(self) -> int:
        return sum(m.rank * (m.in_features + m.out_features) for m in self.modules.values())


def read_adapter(
    name: str, directory: str | Path, linears: Mapping[str, tuple[int, int]], max_rank: int
) -> AdapterSpec:
    """Read and check the adapter in ``directory`` against the base's ``linears`` (path ->
    ``(in_features, out_features)``)."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
    root = Path(directory)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for file in (config_path, weights_path):
        if not file.is_file():
            raise AdapterError(f"adapter {name!r}: no {file.name} in {str(root)!r}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    _check_features(name, config)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: r {rank} exceeds max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    _check_targets(name, config.get("target_modules"), linears)
    shapes = _shapes(name, weights_path)
    modules: dict[str, ModuleLora] = {}
    for key, shape in shapes.items():
        if not key.startswith(_PREFIX) or not key.endswith((_A, _B)):
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight of a linear layer "
                "(only lora_A/lora_B of linear layers are supported)"
            )
        if not key.endswith(_A):
            continue
        path = key[len(_PREFIX) : -len(_A)]
        if path not in linears:
            raise AdapterError(
                f"adapter {name!r}: target module {path!r} is not a linear layer of the base model"
            )
        b_shape = shapes.get(_PREFIX + path + _B)
        if b_shape is None:
            raise AdapterError(f"adapter {name!r}: module {path!r} has lora_A but no lora_B")
        in_features, out_features = linears[path]
        r = shape[0] if len(shape) == 2 else -1
        if len(shape) != 2 or shape[1] != in_features or tuple(b_shape) != (out_features, r):
            raise AdapterError(
                f"adapter {name!r}: module {path!r} has shape lora_A {list(shape)}, lora_B "
                f"{list(b_shape)}; the base model's layer needs [r, {in_features}] and "
                f"[{out_features}, r] (an adapter of a different base model?)"
            )
        if r > max_rank:
            raise AdapterError(
                f"adapter {name!r}: module {path!r} has rank {r}, over max_lora_rank {max_rank}"
            )
        scale = alpha / (math.sqrt(r) if rslora else r)
        modules[path] = ModuleLora(path, r, float(scale), in_features, out_features)
    for key in shapes:
        if key.endswith(_B) and key[len(_PREFIX) : -len(_B)] not in modules:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} has no lora_A")
    if not modules:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return AdapterSpec(name, root, rank, modules)


def load_weights(spec: AdapterSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each module's ``(A [r, in], B [out, r])`` in float32, read from the adapter's file."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(spec.directory / WEIGHTS_FILE), framework="pt") as f:
        for path in spec.modules:
            a = f.get_tensor(_PREFIX + path + _A).float()
            b = f.get_tensor(_PREFIX + path + _B).float()
            out[path] = (a, b)
    return out


def _check_features(name: str, config: dict) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {kind!r} is not supported (only 'LORA')")
    for field, wanted in _UNSUPPORTED.items():
        value = config.get(field, wanted)
        if value != wanted and value is not None:
            raise AdapterError(
                f"adapter {name!r}: {field} {value!r} is not supported (only {wanted!r})"
            )
    for field in _EMPTY:
        value = config.get(field)
        if value:
            raise AdapterError(f"adapter {name!r}: {field} {value!r} is not supported (only none)")


def _check_targets(name: str, targets: object, linears: Mapping[str, tuple[int, int]]) -> None:
    """Each target named in the config must be a linear layer of the base (a regular expression
    or ``all-linear`` is checked through the tensors alone)."""
    if not isinstance(targets, list):
        return
    suffixes = {path.rsplit(".", 1)[-1] for path in linears}
    for target in targets:
        if not isinstance(target, str) or not any(
            path == target or path.endswith("." + target) for path in linears
        ):
            raise AdapterError(
                f"adapter {name!r}: target_modules {target!r} is not a linear layer of the base "
                f"model (it has {', '.join(sorted(suffixes))})"
            )


def _shapes(name: str, path: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"adapter {name!r}: cannot read {path.name}: {exc}") from exc
