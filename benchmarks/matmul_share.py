"""How much of the machine's matmul rate a run's steps reach, phase by phase.

How much of the machine's matmul rate a run's steps reach: the model work of each phase
(2 FLOPs per weight of every decoder linear layer per token, and of the output layer per
sampled row) over the phase's CPU time, against a plain matmul measured in the same process,
dtype and thread count.

Attention's own FLOPs are left out (small beside the weights at these lengths), and so is
the output layer of prefill rows that sample: the share is a lower bound. Both figures use
the CPU time of the stepping thread, the steady clock on a shared machine; run with
``--threads 1`` so that clock counts all the work.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def matmul_rate(
    dtype: torch.dtype, rows: int, inner: int, outer: int, seconds: float = 1.0
) -> float:
    """FLOP per CPU-second of ``[rows, inner] x [inner, outer]`` in ``dtype``, the best of
    several timed rounds."""
    a = torch.randn(rows, inner).to(dtype)
    w = torch.randn(outer, inner).to(dtype)
    flops = 2 * rows * inner * outer
    with torch.inference_mode():
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        best = float("inf")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == float("inf"):
            t0 = time.thread_time()
            for _ in range(5):
                torch.nn.functional.linear(a, w)
            best = min(best, (time.thread_time() - t0) / 5)
    return flops / best if best > 0 else 0.0


def model_weights(runner: Any) -> tuple[int, int]:
    """Weights of the decoder's linear layers (plain or packed), and of the output layer."""
    from engine.cpu.linear import PackedLinear

    def size(m: Any) -> int:
        return m.in_features * m.out_features

    kinds = (torch.nn.Linear, PackedLinear)
    layers = sum(size(m) for m in runner.base.modules() if isinstance(m, kinds))
    return layers, size(runner.lm_head)


def shares(profile: dict[str, Any], layer_weights: int, head_weights: int, rate: float) -> dict:
    """Per phase: model GFLOP per CPU-second and its share of ``rate``."""
    out = {}
    for name, f in profile["phases"].items():
        tokens = f["prefill_tokens"] + f["decode_tokens"]
        flops = 2 * tokens * layer_weights + 2 * f["decode_tokens"] * head_weights
        achieved = flops / f["cpu_s"] if f["cpu_s"] else 0.0
        out[name] = {"gflop_per_cpu_s": achieved / 1e9, "share": achieved / rate if rate else 0.0}
    return out
