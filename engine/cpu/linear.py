"""Linear layers with their weights packed once for oneDNN, on a CPU.

:func:`pack_linears` swaps every ``nn.Linear`` of a module for a :class:`PackedLinear` holding
the weight in oneDNN's blocked layout (the plain weight dropped, so memory does not grow). bf16
always packs; float32 packs where :func:`packing_pays` measures it faster on this CPU. The
operators are PyTorch's own; where they are missing the model is left as it is. What packing
saves: docs/engine-step.md ("Packed linear layers").
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

log = logging.getLogger("engine")


class PackedLinear(torch.nn.Module):
    """``x @ weight.T + bias`` through a weight packed for ``rows_hint`` rows a call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def of(cls, linear: torch.nn.Linear, rows_hint: int) -> PackedLinear:
        """A packed copy of ``linear``, checked against it on a probe input."""
        packed = cls(linear.weight, linear.bias, rows_hint)
        probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        with torch.inference_mode():
            want, got = linear(probe), packed(probe)
        if not torch.allclose(want.float(), got.float(), rtol=2e-2, atol=2e-2):
            raise RuntimeError("packed output differs from nn.Linear")
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        dtype in (torch.bfloat16, torch.float32)
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linears(module: torch.nn.Module, rows_hint: int) -> int:
    """Swap the ``nn.Linear`` children of ``module`` (recursively) for packed ones whose output
    equals theirs on a probe; return how many were swapped (0 when the operators fail)."""
    swaps = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in swaps:
        try:
            packed = PackedLinear.of(child, rows_hint)
        except (RuntimeError, AttributeError) as exc:
            log.info("linear layers left unpacked (%s)", exc)
            return 0
        setattr(parent, name, packed)
    return len(swaps)


def largest_linear(module: torch.nn.Module) -> torch.nn.Linear | None:
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    return max(linears, key=lambda m: m.weight.numel()) if linears else None


# Verdicts of packing_pays by (out, in, dtype, rows): they hold for the process's CPU, so an
# engine loaded again (a restarted host, a second model of the same shape) does not re-time.
_VERDICTS: dict[tuple[int, int, torch.dtype, int], bool] = {}


def packing_pays(layer: torch.nn.Linear, rows: int, repeats: int = 6) -> bool:
    """Whether a packed copy of ``layer`` multiplies at most 0.9x the time ``nn.Linear`` takes
    here, summed over 16, 64 and ``rows`` rows (decode steps run anywhere from a few rows to
    the running cap; medians of alternating calls). Measured once per shape in a process."""
    key = (layer.out_features, layer.in_features, layer.weight.dtype, rows)
    if key not in _VERDICTS:
        _VERDICTS[key] = _time_packing(layer, rows, repeats)
    return _VERDICTS[key]


def _time_packing(layer: torch.nn.Linear, rows: int, repeats: int) -> bool:
    try:
        packed = PackedLinear.of(layer, rows)
    except (RuntimeError, AttributeError):
        return False
    total = {"plain": 0.0, "packed": 0.0}
    with torch.inference_mode():
        for n in sorted({16, 64, rows}):
            x = torch.randn(n, layer.in_features, dtype=layer.weight.dtype)
            times: dict[str, list[float]] = {"plain": [], "packed": []}
            for i in range(repeats + 2):
                for name, candidate in (("plain", layer), ("packed", packed)):
                    start = time.perf_counter()
                    candidate(x)
                    if i >= 2:  # the first calls warm caches and the library
                        times[name].append(time.perf_counter() - start)
            for name, seen in times.items():
                total[name] += statistics.median(seen)
    log.info(
        "%dx%d packed %.0f us against %.0f us plain (16, 64 and %d rows)",
        layer.out_features,
        layer.in_features,
        total["packed"] * 1e6,
        total["plain"] * 1e6,
        rows,
    )
    return total["packed"] <= 0.9 * total["plain"]
