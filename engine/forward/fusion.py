"""Fewer, larger matmuls a layer on a CPU: projections of one input in one call.

A step of a small model on a CPU pays for every operator (a dispatch and a barrier of the
thread team) besides its arithmetic, and a wide matmul runs closer to the CPU's peak than three
narrow ones. :func:`fuse_projections` gives the query/key/value (and gate/up) linear layers
that read the same input one matmul, each layer then a slice of its output; the model's own
``forward`` code runs unchanged. Why and what it measured: docs/engine-step.md.
"""

from __future__ import annotations

import torch

# Sets of sibling projections that models of the Llama family apply to one input.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(torch.nn.Module):
    """One matmul for several linear layers that read the same input (``linear``, which
    packing may swap); :class:`Slice` modules hand out the parts of its output."""

    def __init__(self, layers: list[torch.nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias for layer in layers]
        self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None)
        self.linear.to(weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if self.linear.bias is not None:
                self.linear.bias.copy_(torch.cat([b.detach() for b in biases]))
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part ``index`` of the fused output for ``x``: computed at the first part asked of an
        input, dropped once every part has been handed out."""
        if x is not self._input or self._output is None:
            self._input, self._output, self._served = x, self.linear(x), 0
        lo, hi = self.bounds[index]
        out = self._output[..., lo:hi]
        self._served += 1
        if self._served == len(self.bounds):
            self._input = self._output = None
        return out


class Slice(torch.nn.Module):
    """Stands where one of the fused layers stood; returns its part of the fused output."""

    def __init__(self, fused: FusedLinear, index: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.__dict__["fused"] = fused  # not a child: the fused layer belongs to the parent
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse each set of :data:`SIBLINGS` plain linear layers of one module (same input size,
    all with or all without bias); return how many sets were fused."""
    fused = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            found = [getattr(parent, name, None) for name in names]
            layers: list[torch.nn.Linear] = [f for f in found if type(f) is torch.nn.Linear]
            if len(layers) < len(names):
                continue
            if len({(lay.in_features, lay.bias is None, lay.weight.dtype) for lay in layers}) > 1:
                continue
            holder = FusedLinear(layers)
            parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), holder)
            for index, (name, layer) in enumerate(zip(names, layers, strict=True)):
                setattr(parent, name, Slice(holder, index, layer.in_features, layer.out_features))
            fused += 1
    return fused
