"""Compiled CPU kernels: C sources beside this module, built once per machine, loaded by ctypes.

Built at first use with ``$CC`` (else ``cc``) and ``-O3 -march=native -fopenmp`` into
``$XDG_CACHE_HOME/batchd/kernels``, under a name digesting source, headers, compiler, flags and CPU, so a
shared cache never hands one CPU another's build; written beside and renamed into place. Loaded
after torch, a kernel's OpenMP regions run on the runtime torch already holds (one team of
threads, never two spinning beside each other). Where no compiler is found or the build fails,
:func:`decode_attention` returns None (logged once) and the engine keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger("engine")

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

DecodeAttention = Callable[..., None]
PrefillAttention = Callable[..., bool]
T = TypeVar("T")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchd" / "kernels"


def _cpu_identity() -> str:
    """This CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def build(name: str) -> Path | None:
    """The shared library of ``HERE/name.c`` for this machine, built if it is not cached."""
    source = HERE / f"{name}.c"
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        log.info("no C compiler found (CC or cc): %s runs on its torch path", name)
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("C compiler %s unusable (%s): %s runs on its torch path", compiler, exc, name)
        return None
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(HERE.glob("*.h"))]  # what the sources include
    for part in (source.read_bytes(), *headers, version.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    digest.update(_cpu_identity().encode())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        proc = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            os.unlink(tmp)
            log.warning("building %s failed, torch path kept:\n%s", name, proc.stderr[-2000:])
            return None
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building %s failed (%s), torch path kept", name, exc)
        return None
    return target


def _load(name: str, take: Callable[[ctypes.CDLL], T]) -> T | None:
    """``take`` applied to the shared library of ``name``, built here if need be; None (the
    reason logged) where it cannot be built, loaded or lacks what ``take`` reads."""
    path = build(name)
    if path is None:
        return None
    try:
        return take(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        log.warning("loading %s failed (%s), torch path kept", path, exc)
        return None


@functools.cache
def decode_attention() -> DecodeAttention | None:
    """``f(q, k_cache, v_cache, blocks, lens, window, scale, out)``: decode attention of ``n``
    rows in float32 or bfloat16 (every tensor the same), or None where the kernel cannot be
    built here.

    ``q`` [n, heads, dim] (any row and head strides, dim contiguous); ``k_cache``/``v_cache``
    one layer's cache, ``[kv_heads, blocks, block_size, dim]`` contiguous; ``blocks`` [n, width]
    and ``lens`` [n] int64 (each sequence's block ids and keys); ``window`` 0 for none; ``out``
    [n, heads, dim] contiguous. Runs on torch's current number of intra-op threads."""
    fn = _load("decode_attention", lambda lib: lib.batchd_decode_attention)
    if fn is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr]
    fn.argtypes += [i32, i32, i32, i32, i32, i32, i32, ctypes.c_float, ptr, i32]
    fn.restype = i32

    def run(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        lens: torch.Tensor,
        window: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        n, heads, dim = q.shape
        kv_heads, _, block_size, _ = k_cache.shape
        rc = fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            blocks.data_ptr(),
            blocks.stride(0),
            lens.data_ptr(),
            n,
            heads,
            kv_heads,
            dim,
            block_size,
            window,
            int(q.dtype == torch.bfloat16),
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 2:
            raise ValueError(f"decode attention kernel: head_dim {dim} over its 1,024")
        if rc != 0:
            raise MemoryError("decode attention kernel: no scratch memory")

    return run


@functools.cache
def prefill_attention() -> PrefillAttention | None:
    """``f(q, k, v, blocks, block_size, first_pos, scale, out) -> bool``: causal float32
    attention of one prefill chunk, or None where the kernel cannot be built here.

    ``q`` [n, heads, dim] (any row and head strides, dim contiguous) at positions
    ``first_pos .. first_pos + n - 1``; ``k``/``v`` the layer's cache ``[kv_heads, blocks,
    block_size, dim]`` (contiguous) read through ``blocks`` (the sequence's block ids, int64),
    or, with ``blocks`` None, the chunk's own keys ``[kv_heads, n, dim]`` (any strides, dim
    contiguous; ``first_pos`` 0); ``out`` [n, heads, dim] with contiguous heads. Returns False
    (nothing written) for a head size the kernel has no loop for (16, 32, 64 and 128 have).
    None too where the CPU has no AVX-512: the build there is slower than torch's operator."""
    loaded = _load(
        "prefill_attention",
        lambda lib: (lib.batchd_prefill_attention, lib.batchd_prefill_attention_fast),
    )
    if loaded is None:
        return None
    fn, fast = loaded
    if not fast():
        log.info("no AVX-512 here: prefill chunks keep torch's flash operator")
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i32, i64, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, ptr, i64, i32]
    fn.restype = i32

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor | None,
        block_size: int,
        first_pos: int,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        n, heads, dim = q.shape
        paged = blocks is not None
        rc = fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            dim if paged else k.stride(1),
            blocks.data_ptr() if paged else None,
            block_size,
            first_pos,
            n,
            heads,
            k.shape[0],
            dim,
            scale,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc == 1:
            raise MemoryError("prefill attention kernel: no scratch memory")
        return rc == 0

    return run


class Sgemm:
    """float32 linear layers on weights packed once (``sgemm.c``), on torch's current number
    of intra-op threads."""

    PANEL = 32  # output columns a packed panel holds

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack = lib.batchd_sgemm_pack
        self._pack.argtypes = [ptr, i32, i32, ptr]
        self._pack.restype = None
        self._run = lib.batchd_sgemm
        self._run.argtypes = [ptr, i64, i32, i32, ptr, i32, ptr, ptr, i64, i32]
        self._run.restype = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [n, k] float32 in 32-column panels (the last zero-padded), a new tensor."""
        n, k = weight.shape
        w = weight.detach().contiguous()
        packed = torch.empty(-(-n // self.PANEL) * self.PANEL * k, dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [m, k] (rows contiguous) times the packed weight of ``n`` outputs, plus
        ``bias``: a new [m, n] tensor."""
        m, k = x.shape
        out = x.new_empty(m, n)
        self._run(
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            packed.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        return out


@functools.cache
def sgemm() -> Sgemm | None:
    """The compiled :class:`Sgemm`, or None where it cannot be built here or the CPU has no
    AVX-512 (there its tiles spill and oneDNN is faster)."""
    loaded = _load("sgemm", lambda lib: (Sgemm(lib), lib.batchd_sgemm_fast()))
    return loaded[0] if loaded is not None and loaded[1] else None


class LayerOps:
    """The float32 work of a Llama layer between its matmuls (``layer_ops.c``), on torch's
    current number of intra-op threads. Every tensor float32 on the CPU, rows contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = lib.batchd_rms_norm
        self._norm.argtypes = [ptr, ptr, i64, ptr, f32, i32, i32, ptr, i32]
        self._norm.restype = None
        self._rope = lib.batchd_rope_store
        self._rope.argtypes = [ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, i64, ptr, i32]
        self._rope.restype = i32
        self._silu = lib.batchd_silu_mul
        self._silu.argtypes = [ptr, i64, i32, i32, ptr, i32]
        self._silu.restype = None
        self._argmax = lib.batchd_argmax
        self._argmax.argtypes = [ptr, i64, i32, i64, ptr, i32]
        self._argmax.restype = None

    def rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``hidden += delta`` in place (``delta`` None: nothing added), then the RMS norm of
        ``hidden`` [rows, dim] times ``weight``, a new tensor."""
        rows, dim = hidden.shape
        out = torch.empty_like(hidden)
        self._norm(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            weight.data_ptr(),
            eps,
            rows,
            dim,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate the query and key heads of ``qkv`` [rows, (heads + 2 kv_heads) * dim] in place
        by ``cos``/``sin`` [rows, dim]; write keys and values to the caches
        ``[kv_heads, blocks, block_size, dim]`` at ``slots`` [rows] (int64)."""
        dim = k_cache.shape[-1]
        rc = self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            heads,
            kv_heads,
            dim,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            slots.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"rope kernel: head_dim {dim} odd or over its 1,024")

    def silu_mul(self, gate_up: torch.Tensor, inner: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` [rows, 2 inner] (gate first), a new tensor."""
        rows = gate_up.shape[0]
        out = gate_up.new_empty(rows, inner)
        self._silu(
            gate_up.data_ptr(),
            gate_up.stride(0),
            rows,
            inner,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of ``logits`` [rows, cols] (int64): the first largest, a
        NaN counting as largest."""
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._argmax(
            logits.data_ptr(),
            logits.stride(0),
            rows,
            cols,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


@functools.cache
def layer_ops() -> LayerOps | None:
    """The compiled :class:`LayerOps`, or None where they cannot be built here."""
    return _load("layer_ops", LayerOps)
