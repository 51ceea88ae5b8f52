"""Linear layers with their weights packed once, on a CPU: for oneDNN, MKL's packed GEMM or the
compiled float32 GEMM (engine/cpu/csrc/sgemm.c).

:func:`pack_linears` swaps every ``nn.Linear`` of a module for a :class:`PackedLinear` holding
the weight in the library's blocked layout (the plain weight dropped, so memory does not grow).
:func:`choose_packing` decides: the compiled GEMM where it is built for the layer's dtype
(float32 with AVX-512, bf16 with AVX-512 BF16), whose rows do not depend on the rows beside
them; otherwise bf16 packs for oneDNN, and float32 for whichever library :func:`packing_for`
measures fastest on this CPU, if any beats the plain weight. The library operators are
PyTorch's own; where they are missing the model is left as it is. What packing saves:
docs/engine-step.md ("Packed linear layers").

Which library a shape packs for changes the float bits of every step, so it is decided once per
machine, not at every start: :func:`recorded_packing` times a shape the first time a machine
sees it and records the verdict in the kernel cache (:func:`engine.cpu.kernels.machine_record`);
every later start reads it, whatever the machine's load. ``EngineConfig.cpu_gemm`` forces one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.cpu.kernels import Gemm, bgemm, machine_record, sgemm

log = logging.getLogger("engine")


KINDS = ("onednn", "mkl", "batchd")  # the libraries a weight packs for


class PackedLinear(torch.nn.Module):
    """``x @ weight.T + bias`` through a weight packed for ``kind``, blocked for ``rows_hint``
    rows a call (oneDNN; MKL's packed weight serves any number of rows)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int, kind: str = "onednn"
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kind = kind
        w = weight.detach()
        if kind == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows_hint)
            # MKL's operator reads only the plain weight's sizes when it multiplies the packed
            # one (with the true row count as its batch size): a stand-in with no storage.
            self.sizes = torch.empty((), dtype=w.dtype).expand(self.out_features, self.in_features)
        elif kind == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        elif kind == "batchd":
            gemm = compiled_gemm(w.dtype)
            if gemm is None:
                raise RuntimeError(f"no compiled {w.dtype} GEMM is built here")
            self.gemm = gemm
            self.packed = gemm.pack(w)
        else:
            raise ValueError(f"unknown packing {kind!r}: one of {KINDS}")
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def of(cls, linear: torch.nn.Linear, rows_hint: int, kind: str = "onednn") -> PackedLinear:
        """A packed copy of ``linear``, checked against it on a probe input."""
        packed = cls(linear.weight, linear.bias, rows_hint, kind)
        probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        with torch.inference_mode():
            want, got = linear(probe), packed(probe)
        if not torch.allclose(want.float(), got.float(), rtol=2e-2, atol=2e-2):
            raise RuntimeError("packed output differs from nn.Linear")
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        two_d = x.dim() == 2  # a step's rows, as the lean forward passes them: no reshapes
        flat = x if two_d else x.reshape(-1, self.in_features)
        if self.kind == "batchd":
            out = self.gemm.linear(flat.contiguous(), self.packed, self.out_features, self.bias)
        elif self.kind == "mkl":
            rows = flat.shape[0]
            out = torch.ops.mkl._mkl_linear(flat, self.packed, self.sizes, self.bias, rows)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out if two_d else out.view(*x.shape[:-1], self.out_features)


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        dtype in (torch.bfloat16, torch.float32)
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def compiled_gemm(dtype: torch.dtype) -> Gemm | None:
    """The compiled GEMM for ``dtype`` built here: float32 with AVX-512, bf16 with AVX-512
    BF16; None otherwise."""
    if dtype == torch.float32:
        return sgemm()
    return bgemm() if dtype == torch.bfloat16 else None


def kinds_for(dtype: torch.dtype, compiled: bool = True) -> tuple[str, ...]:
    """The packings at hand for ``dtype``: MKL's packed GEMM is float32 only; the compiled one
    is there where :func:`compiled_gemm` builds it (and ``compiled`` allows it)."""
    ours = ("batchd",) if compiled and compiled_gemm(dtype) is not None else ()
    if dtype != torch.float32:
        return ("onednn", *ours)
    mkl = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return ("onednn",) + (("mkl",) if mkl else ()) + ours


def pack_linears(module: torch.nn.Module, rows_hint: int, kind: str = "onednn") -> int:
    """Swap the ``nn.Linear`` children of ``module`` (recursively) for ones packed for ``kind``
    whose output equals theirs on a probe; return how many were swapped (0 when the operators
    fail)."""
    swaps = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in swaps:
        try:
            packed = PackedLinear.of(child, rows_hint, kind)
        except (RuntimeError, AttributeError) as exc:
            log.info("linear layers left unpacked (%s)", exc)
            return 0
        setattr(parent, name, packed)
    return len(swaps)


def largest_linear(module: torch.nn.Module) -> torch.nn.Linear | None:
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    return max(linears, key=lambda m: m.weight.numel()) if linears else None


# Verdicts of packing_for by (out, in, dtype, rows): they hold for the process's CPU, so an
# engine loaded again (a restarted host, a second model of the same shape) does not re-time.
_VERDICTS: dict[tuple[int, int, torch.dtype, int], str | None] = {}


def packing_for(
    layer: torch.nn.Linear, rows: int, repeats: int = 6, compiled: bool = True
) -> str | None:
    """The packing (one of :data:`KINDS`) that multiplies fastest here, if it takes at most
    0.9x the time ``nn.Linear`` takes, summed over 16, 64 and ``rows`` rows (decode steps run
    anywhere from a few rows to the running cap; medians of alternating calls); None when none
    pays. Measured once per shape in a process (``compiled``: the compiled GEMM a candidate)."""
    key = (layer.out_features, layer.in_features, layer.weight.dtype, rows)
    if not compiled:
        return _time_packing(layer, rows, repeats, compiled=False)
    verdict = _VERDICTS.get(key, "")
    if verdict != "" and (verdict is None or verdict in kinds_for(layer.weight.dtype)):
        return verdict
    # Not timed yet, or a packing no longer at hand (a library unloaded since).
    _VERDICTS[key] = _time_packing(layer, rows, repeats)
    return _VERDICTS[key]


RECORD = "gemm-choices"  # the record's name in the kernel cache
PLAIN = "plain"  # a recorded or forced verdict: the plain weight, nn.Linear's own


def recorded_packing(layer: torch.nn.Linear, rows: int, compiled: bool = True) -> str | None:
    """:func:`packing_for` decided once per machine: the verdict this machine recorded for the
    shape, else timed now (under a lock on the record, so two processes starting together time
    it once) and recorded. A recorded packing no longer at hand (the compiled GEMM not built
    here any more) is timed again. ``compiled`` False: the compiled GEMM is no candidate (a
    question of its own in the record)."""
    dtype = str(layer.weight.dtype).removeprefix("torch.")
    key = f"{layer.out_features}x{layer.in_features}:{dtype}:{rows}" + (
        "" if compiled else ":torch"
    )
    path = machine_record(RECORD)
    with _locked(path):
        table = _read_record(path)
        seen = table.get(key)
        if seen == PLAIN:
            return None
        if seen in kinds_for(layer.weight.dtype, compiled):
            return seen
        verdict = packing_for(layer, rows, compiled=compiled)
        table[key] = verdict or PLAIN
        _write_record(path, table)
        log.info("GEMM for %s: %s, recorded in %s", key, verdict or PLAIN, path)
        return verdict


def choose_packing(layer: torch.nn.Linear, rows: int, forced: str, compiled: bool) -> str | None:
    """The packing ``layer`` takes: ``forced`` (``EngineConfig.cpu_gemm``; ``auto`` decides: the
    compiled GEMM where it is built for the layer's dtype, since its rows do not depend on the
    step; else bf16 packs for oneDNN and float32 as :func:`recorded_packing` says); None for
    the plain weight. ``compiled`` False: the compiled GEMM is never taken. A forced packing
    not at hand here is a ValueError naming what is."""
    dtype = layer.weight.dtype
    if forced == "auto":
        if "batchd" in kinds_for(dtype, compiled):
            return "batchd"  # a row's result whatever the step holds (batch-invariant)
        if dtype != torch.float32:
            return "onednn"
        return recorded_packing(layer, rows, compiled)
    if forced == PLAIN:
        return None
    at_hand = kinds_for(dtype, compiled)
    if forced not in at_hand:
        raise ValueError(
            f"cpu_gemm {forced!r} is not at hand for {dtype} here"
            + ("" if compiled else " with cpu_kernels off")
            + f": one of {[PLAIN, *at_hand]}, or 'auto'"
        )
    return forced


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s lock file for the block (none where it cannot be had)."""
    try:
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_record(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, dict):
        return {}
    return {str(k): str(v) for k, v in choices.items() if v in (*KINDS, PLAIN)}


def _write_record(path: Path, table: dict[str, str]) -> None:
    """Replace the record atomically (a reader sees the old one or the new one, whole)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump({"torch": torch.__version__, "choices": table}, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(
            "GEMM choices not recorded in %s (%s): the next start times them again", path, exc
        )


def _time_packing(
    layer: torch.nn.Linear, rows: int, repeats: int, compiled: bool = True
) -> str | None:
    candidates: dict[str, torch.nn.Module] = {"plain": layer}
    for kind in kinds_for(layer.weight.dtype, compiled):
        try:
            candidates[kind] = PackedLinear.of(layer, rows, kind)
        except (RuntimeError, AttributeError):
            continue
    total = dict.fromkeys(candidates, 0.0)
    with torch.inference_mode():
        for n in sorted({16, 64, rows}):
            x = torch.randn(n, layer.in_features, dtype=layer.weight.dtype)
            times: dict[str, list[float]] = {name: [] for name in candidates}
            for i in range(repeats + 2):
                for name, candidate in candidates.items():
                    start = time.perf_counter()
                    candidate(x)
                    if i >= 2:  # the first calls warm caches and the library
                        times[name].append(time.perf_counter() - start)
            for name, seen in times.items():
                total[name] += statistics.median(seen)
    log.info(
        "%dx%d over 16, 64 and %d rows: %s",
        layer.out_features,
        layer.in_features,
        rows,
        ", ".join(f"{name} {t * 1e6:.0f} us" for name, t in total.items()),
    )
    return fastest(total)


def fastest(times: dict[str, float]) -> str | None:
    """The packing of least time in ``times`` (which holds ``plain`` too), if it takes at most
    0.9x the plain weight's time; None otherwise."""
    best = min((k for k in times if k != "plain"), key=times.__getitem__, default=None)
    return best if best is not None and times[best] <= 0.9 * times["plain"] else None
