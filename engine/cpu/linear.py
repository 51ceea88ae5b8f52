"""Linear layers with their weights packed once for oneDNN, for bf16 on a CPU.

A bf16 ``F.linear`` on a CPU hands oneDNN a plain weight on every call; a weight reordered
once into oneDNN's blocked layout skips that work, which at decode sizes (32-128 rows) is
10-25% of the matmul (and more for thin layers). :func:`pack_linears` swaps every
``nn.Linear`` of a module for a :class:`PackedLinear` holding the packed weight; the plain
weight is dropped, so memory does not grow. Used only for bf16 on CPU, where it pays; float32
and accelerators keep ``nn.Linear``. The operators are PyTorch's own (those ``torch.compile``
uses for the same purpose); where they are missing the model is left as it is.
"""

from __future__ import annotations

import logging

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
        dtype == torch.bfloat16
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
