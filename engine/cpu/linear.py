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


def packing_pays(module: torch.nn.Module, rows: int, repeats: int = 12) -> bool:
    """Whether a packed copy of ``module``'s largest linear layer multiplies ``rows`` rows at
    most 0.9x the time ``nn.Linear`` takes here (median of alternating calls; a few ms)."""
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return False
    largest = max(linears, key=lambda m: m.weight.numel())
    try:
        packed = PackedLinear.of(largest, rows)
    except (RuntimeError, AttributeError):
        return False
    x = torch.randn(rows, largest.in_features, dtype=largest.weight.dtype)
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    with torch.inference_mode():
        for i in range(repeats + 2):
            for name, layer in (("plain", largest), ("packed", packed)):
                start = time.perf_counter()
                layer(x)
                if i >= 2:  # the first calls warm caches and the library
                    times[name].append(time.perf_counter() - start)
    plain, fast = statistics.median(times["plain"]), statistics.median(times["packed"])
    log.info(
        "packed linear %.0f us against %.0f us plain at %d rows", fast * 1e6, plain * 1e6, rows
    )
    return fast <= 0.9 * plain
