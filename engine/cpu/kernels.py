"""Compiled CPU kernels: C sources beside this module, built once per machine, loaded by ctypes.

Built at first use with ``$CC`` (else ``cc``) and ``-O3 -march=native -fopenmp`` into
``$XDG_CACHE_HOME/batchd/kernels`` (:func:`cache_dir`). A build is found by a name that digests
the source, headers, compiler, flags and CPU (:func:`_cpu_identity`: the compiler's own reading
of ``-march=native`` and the CPU lines of ``/proc/cpuinfo``), so a shared cache never hands one
CPU another's build, followed by the sha256 of the library's bytes, checked before it is
loaded: a library whose bytes no longer match is removed and built again, never loaded. The
cache directory must belong to this process's user and be writable by no one else (nor may
the directory above it, unless sticky); where it is not, a warning names it and why, and the
process builds into a private temporary directory instead (removed at exit). A build is
compiled in a private directory inside the cache (the compiler's own temporary files too) and
renamed into place, so processes building at once never load half a file, and a build that
fails or runs past :data:`COMPILE_TIMEOUT_S` (its whole process group killed) leaves nothing
behind. Loaded after torch, a kernel's OpenMP regions run on the runtime torch already holds
(one team of threads, never two spinning beside each other). Where no compiler is found or the
build fails, every kernel's loader (:func:`decode_attention`, :func:`prefill_attention`,
:func:`sgemm`, :func:`bgemm`, :func:`layer_ops`) returns None (logged once) and the engine keeps
its torch path for that kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from engine.cpu import abi

log = logging.getLogger("engine")

CSRC = Path(__file__).resolve().parent / "csrc"  # the C sources and their one header
# Warnings are errors: a kernel that does not build clean is not loaded (the engine keeps its
# torch path, and the tests that build it fail). -Wno-psabi: the sources pass 64-byte vectors
# between static functions, which GCC warns about where a build has no AVX-512 (no ABI is
# crossed). Flags a source's arithmetic relies on are its own (SOURCE_FLAGS), on the command
# line, not in a pragma a compiler may ignore.
FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
    "-Wall", "-Wextra", "-Werror", "-Wno-psabi",
)  # fmt: skip
SOURCE_FLAGS = {"layer_ops": ("-ffp-contract=off",)}  # rounded where transformers rounds
COMPILE_TIMEOUT_S = 120.0
CPUINFO = Path("/proc/cpuinfo")
# The /proc/cpuinfo fields that say what a CPU executes, on x86 (vendor, family, model, flags),
# ARM (Features, implementer, architecture, variant, part), RISC-V (isa, uarch), POWER (cpu)
# and s390x (features); not those that change from boot to boot (MHz, BogoMIPS).
CPU_FIELDS = frozenset(
    {
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "flags",
        "Features",
        "CPU implementer",
        "CPU architecture",
        "CPU variant",
        "CPU part",
        "CPU revision",
        "Processor",
        "isa",
        "uarch",
        "mvendorid",
        "marchid",
        "cpu",
        "features",
    }
)
# The head sizes the compiled decode attention and rotary embedding take at most (MAX_DIM in
# decode_attention.c, the check in layer_ops.c): a model with larger heads keeps torch's path.
MAX_HEAD_DIM = 1024
_ELEMENT_TYPES = (torch.float32, torch.bfloat16)  # what the attention kernels read

DecodeAttention = Callable[..., None]
PrefillAttention = Callable[..., bool]
T = TypeVar("T")


def cache_dir() -> Path:
    """Where builds are cached: ``$XDG_CACHE_HOME/batchd/kernels`` (``~/.cache`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchd" / "kernels"


def _unsafe(st: os.stat_result, *, ours: bool) -> str | None:
    """Why a directory or file of this ``st`` may not hold what this process loads, or None.
    ``ours``: it must belong to this user and be writable by no one else; otherwise (the
    directory above the cache) root may own it and a sticky bit makes others' write harmless."""
    uid = os.geteuid()
    if st.st_uid != uid and (ours or st.st_uid != 0):
        return f"owned by uid {st.st_uid}, not this process's uid {uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 and (ours or not mode & stat.S_ISVTX):
        return f"writable by group or others (mode {mode:o})"
    return None


def _prepare(directory: Path) -> str | None:
    """Create ``directory`` (``base/batchd/kernels``) where missing, private to this user;
    return why it may not be used, or None."""
    base = directory.parent.parent
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = _unsafe(base.stat(), ours=False)
    if reason is not None:
        return f"{base} is {reason}"
    for path in (directory.parent, directory):
        path.mkdir(mode=0o700, exist_ok=True)  # the mode only removes bits from the umask's
        reason = _unsafe(path.stat(), ours=True)
        if reason is not None:
            return f"{path} is {reason}"
    return None


_REFUSED: set[Path] = set()


@functools.cache
def _private_dir() -> Path:
    """A directory of this process alone, removed when it exits (not by a forked child)."""
    path = Path(tempfile.mkdtemp(prefix="batchd-kernels-"))
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def _kernel_dir() -> Path:
    """:func:`cache_dir` where it is safe to load from, else this process's private directory
    (a warning once per refused directory, naming it and why)."""
    wanted = cache_dir()
    try:
        reason = _prepare(wanted)
    except OSError as exc:
        reason = f"not usable ({exc})"
    if reason is None:
        return wanted
    if wanted not in _REFUSED:
        _REFUSED.add(wanted)
        log.warning(
            "kernel cache %s refused: %s; this process builds its kernels in a private "
            "directory instead (give the directory to this user and chmod go-w, or remove it)",
            wanted,
            reason,
        )
    return _private_dir()


@functools.cache
def _native_target(compiler: str) -> str:
    """The target options ``compiler`` makes of ``-march=native`` here (GCC's ``cc1`` line,
    Clang's ``-cc1`` line): what the build's instructions follow, on every architecture, or
    "" where the compiler does not say."""
    try:
        proc = subprocess.run(
            [compiler, "-march=native", "-E", "-v", "-x", "c", "-", "-o", os.devnull],
            input="",
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in proc.stderr.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if not words or not (words[0].endswith("cc1") or "-cc1" in words):
            continue
        kept = []
        for i, word in enumerate(words):
            if word in ("-triple", "-target-cpu", "-target-feature", "-target-abi"):
                kept.append(f"{word} {words[i + 1] if i + 1 < len(words) else ''}")
            elif word.startswith("-m"):
                kept.append(word)
        return " ".join(kept)
    return ""


def _cpu_identity(compiler: str | None, cpuinfo: Path | None = None) -> str:
    """What ``-march=native`` compiles for on this CPU: the compiler's reading of it and the
    lines of :data:`CPU_FIELDS` in ``cpuinfo`` (``/proc/cpuinfo``); "" where neither says
    anything (then no build is shared)."""
    try:
        lines = (cpuinfo or CPUINFO).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    keep = sorted({ln.strip() for ln in lines if ln.split(":")[0].strip() in CPU_FIELDS})
    native = _native_target(compiler) if compiler else ""
    if not keep and not native:
        return ""
    return "\n".join([platform.machine(), native, *keep])


def _sha256_of(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _sound(path: Path, fd: int) -> bool:
    """Whether the open library ``fd`` of ``path`` belongs to this user, is writable by no
    one else and has the sha256 its name ends with."""
    return _unsafe(os.fstat(fd), ours=True) is None and path.stem.endswith(f"-{_sha256_of(fd)}")


def _verified(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _sound(path, fd)
    finally:
        os.close(fd)


def _kill_group(pgid: int) -> None:
    """Kill what is left of process group ``pgid`` (a compiler's own children) and wait, up to
    5 s, until none of it is left to write a file."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    for _ in range(500):
        try:
            os.killpg(pgid, 0)
        except OSError:
            return
        time.sleep(0.01)


def _compile(
    compiler: str, flags: tuple[str, ...], source: Path, directory: Path, stem: str
) -> Path | None:
    """``source`` built in a private directory inside ``directory`` (the compiler's temporary
    files there too), renamed to ``stem-<sha256>.so``; the private directory removed, whatever
    happened, once nothing the compiler started is left running."""
    name = source.stem
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory))
    try:
        out = work / f"{name}.so"
        proc = subprocess.Popen(
            [compiler, *flags, "-o", str(out), str(source), "-lm"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: all of it can be killed
            env={**os.environ, "TMPDIR": str(work)},
        )
        err: str | None = None
        try:
            _, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        finally:
            _kill_group(proc.pid)
        if err is None:
            log.warning("building %s ran past %s s, torch path kept", name, COMPILE_TIMEOUT_S)
            return None
        if proc.returncode != 0:
            log.warning("building %s failed, torch path kept:\n%s", name, err[-2000:])
            return None
        out.chmod(0o755)
        fd = os.open(out, os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = directory / f"{stem}-{_sha256_of(fd)}.so"
        finally:
            os.close(fd)
        os.replace(out, target)
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building %s failed (%s), torch path kept", name, exc)
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def machine_record(name: str) -> Path:
    """A file of this machine's choices named ``name`` (JSON) in the kernel cache: its name
    digests the CPU (as builds do) and torch's version, so a record is never read on another
    CPU or under another torch. The directory is :func:`cache_dir` where it is safe, else this
    process's private one."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    key = "\n".join([_cpu_identity(compiler), torch.__version__, sys.platform])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _kernel_dir() / f"{name}-{digest}.json"


def build(name: str) -> Path | None:
    """The shared library of ``csrc/name.c`` for this machine, built if it is not cached (or
    its cached bytes no longer match their digest)."""
    source = CSRC / f"{name}.c"
    flags = (*FLAGS, *SOURCE_FLAGS.get(name, ()))
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
    identity = _cpu_identity(compiler)
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # what the sources include
    for part in (source.read_bytes(), *headers, version.encode(), " ".join(flags).encode()):
        digest.update(part)
    digest.update(identity.encode())
    if identity:
        directory = _kernel_dir()
    else:
        log.info("neither %s nor %s names this CPU: kernels built privately", compiler, CPUINFO)
        directory = _private_dir()
    stem = f"{name}-{digest.hexdigest()[:16]}"
    for found in sorted(directory.glob(f"{stem}-*.so")):
        if _verified(found):
            return found
        log.warning("%s does not match its digest: removed, built again", found)
        found.unlink(missing_ok=True)
    return _compile(compiler, flags, source, directory, stem)


def _open(path: Path) -> ctypes.CDLL | None:
    """``path`` loaded if its bytes still match their digest, else None. (Loaded by its path,
    not ``/proc/self/fd``: the dynamic loader takes a path it has loaded before for the same
    library, and descriptor numbers are reused.)"""
    if not _verified(path):
        return None
    return ctypes.CDLL(str(path))


def _load(name: str, take: Callable[[ctypes.CDLL], T]) -> T | None:
    """``take`` applied to the shared library of ``name``, built here if need be; None (the
    reason logged) where it cannot be built, loaded or lacks what ``take`` reads."""
    path = build(name)
    if path is None:
        return None
    try:
        lib = _open(path)
        if lib is None:
            log.warning("%s changed after it was checked: not loaded, torch path kept", path)
            return None
        return take(lib)
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
    fn = _load("decode_attention", lambda lib: abi.bind(lib, "batchd_decode_attention"))
    if fn is None:
        return None

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
        _same_type("decode attention kernel", q, k_cache, v_cache, out)
        _require(
            "decode attention kernel",
            q.stride(-1) == 1
            and k_cache.is_contiguous()
            and v_cache.shape == k_cache.shape
            and v_cache.is_contiguous()
            and k_cache.shape[-1] == dim
            and heads % kv_heads == 0
            and out.shape == q.shape
            and out.is_contiguous(),
            "q [n, heads, dim] with dim contiguous; contiguous caches [kv_heads, blocks, "
            "block_size, dim] of that dim; out like q, contiguous",
        )
        _indices("decode attention kernel", blocks, 2, n)
        _indices("decode attention kernel", lens, 1, n)
        args = abi.DecodeArgs(
            q=q.data_ptr(),
            q_row=q.stride(0),
            q_head=q.stride(1),
            k=k_cache.data_ptr(),
            v=v_cache.data_ptr(),
            kv_head=k_cache.stride(0),
            blocks=blocks.data_ptr(),
            max_blocks=blocks.stride(0),
            lens=lens.data_ptr(),
            n=n,
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            block_size=block_size,
            window=window,
            bf16=int(q.dtype == torch.bfloat16),
            scale=scale,
            out=out.data_ptr(),
            threads=torch.get_num_threads(),
        )
        rc = fn(ctypes.byref(args))
        if rc == 2:
            raise ValueError(f"decode attention kernel: head_dim {dim} over its {MAX_HEAD_DIM}")
        if rc != 0:
            raise MemoryError("decode attention kernel: no scratch memory")

    return run


class PrefillKernel:
    """The compiled prefill attention (``prefill_attention.c``) and the scratch it keeps.

    Called as ``f(q, k, v, blocks, block_size, first_pos, scale, out) -> bool``: causal
    attention of one prefill chunk, every tensor float32 or every one bfloat16 (widened on
    load, sums in float32, rounded where torch's CPU flash attention rounds). ``q`` [n, heads, dim] (any row and head strides,
    dim contiguous) at positions ``first_pos .. first_pos + n - 1``; ``k``/``v`` the layer's
    cache ``[kv_heads, blocks, block_size, dim]`` (contiguous) read through ``blocks`` (the
    sequence's block ids, int64), or, with ``blocks`` None, the chunk's own keys ``[kv_heads,
    n, dim]`` (any strides, dim contiguous; ``first_pos`` 0); ``out`` [n, heads, dim] with
    contiguous heads. Returns False (nothing written) for a head size the kernel has no loop
    for (16, 32, 64 and 128 have). Runs on torch's current number of intra-op threads.

    A calling thread keeps the transposed keys of one tile between calls, at most
    :meth:`scratch_bound` bytes whatever the prompt's length (the engine's memory budget
    subtracts it), freed when the thread exits or by :meth:`release`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._run = abi.bind(lib, "batchd_prefill_attention")
        self._bound = abi.bind(lib, "batchd_prefill_attention_bound")
        self._held = abi.bind(lib, "batchd_prefill_attention_held")
        self._release = abi.bind(lib, "batchd_prefill_attention_release")

    def __call__(
        self,
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
        if not q.dtype == k.dtype == v.dtype == out.dtype or q.dtype not in _ELEMENT_TYPES:
            raise TypeError(
                f"prefill attention kernel: q, k, v and out all float32 or all bfloat16, not "
                f"{q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}"
            )
        _require(
            "prefill attention kernel",
            q.stride(-1) == 1
            and out.shape == q.shape
            and out.stride(-1) == 1
            and out.stride(1) == dim
            and k.shape[-1] == dim
            and v.shape == k.shape
            and v.stride() == k.stride()
            and heads % k.shape[0] == 0
            and (k.is_contiguous() if paged else k.dim() == 3 and k.stride(-1) == 1),
            "q [n, heads, dim] and out like it with contiguous heads; k and v alike: a "
            "contiguous cache [kv_heads, blocks, block_size, dim], or the chunk's own "
            "[kv_heads, n, dim] with dim contiguous",
        )
        if blocks is not None:
            _indices("prefill attention kernel", blocks, 1, -(-(first_pos + n) // block_size))
        args = abi.PrefillArgs(
            q=q.data_ptr(),
            q_row=q.stride(0),
            q_head=q.stride(1),
            k=k.data_ptr(),
            v=v.data_ptr(),
            kv_head=k.stride(0),
            key_row=dim if paged else k.stride(1),
            blocks=None if blocks is None else blocks.data_ptr(),
            block_size=block_size,
            first_pos=first_pos,
            n_q=n,
            heads=heads,
            kv_heads=k.shape[0],
            dim=dim,
            scale=scale,
            out=out.data_ptr(),
            out_row=out.stride(0),
            threads=torch.get_num_threads(),
            bf16=int(q.dtype == torch.bfloat16),
        )
        rc = self._run(ctypes.byref(args))
        if rc == 1:
            raise MemoryError("prefill attention kernel: no scratch memory")
        return rc == 0

    def scratch_bound(self, kv_heads: int, head_dim: int) -> int:
        """Bytes a calling thread keeps, at most, for a model of this shape."""
        return int(self._bound(kv_heads, head_dim))

    def scratch_bytes(self) -> int:
        """Bytes every thread keeps now."""
        return int(self._held())

    def release(self) -> None:
        """Free the calling thread's scratch (its next call takes it again)."""
        self._release()


@functools.cache
def prefill_attention() -> PrefillKernel | None:
    """The compiled :class:`PrefillKernel`, or None where it cannot be built here, or where
    the CPU has no AVX-512: the build there is slower than torch's operator."""
    loaded = _load(
        "prefill_attention",
        lambda lib: (PrefillKernel(lib), lib.batchd_prefill_attention_fast),
    )
    if loaded is None:
        return None
    kernel, fast = loaded
    if not fast():
        log.info("no AVX-512 here: prefill chunks keep torch's flash operator")
        return None
    return kernel


class Gemm:
    """Linear layers on weights packed once, on torch's current number of intra-op threads:
    float32 (``sgemm.c``) or bfloat16 on the CPU's bf16 dot-product unit (``bgemm.c``), one
    element type a library. A row's output does not depend on the rows beside it in a call."""

    PANEL = 32  # output columns a packed panel holds

    def __init__(self, lib: ctypes.CDLL, prefix: str, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._pack = abi.bind(lib, f"{prefix}_pack")
        self._run = abi.bind(lib, prefix)

    def _elements(self, n: int, k: int) -> int:
        """Elements of the packed weight: float32 panels [k][32]; bf16 panels of k pairs."""
        k = k if self.dtype == torch.float32 else 2 * -(-k // 2)
        return -(-n // self.PANEL) * self.PANEL * k

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [n, k] of this library's dtype in 32-column panels (the last zero-padded),
        a new tensor."""
        if weight.dtype != self.dtype or weight.dim() != 2:
            raise TypeError(f"GEMM packing: a 2-D {self.dtype} weight, not {weight.dtype}")
        n, k = weight.shape
        w = weight.detach().contiguous()
        packed = torch.empty(self._elements(n, k), dtype=self.dtype)
        self._pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [m, k] (rows contiguous) times the packed weight of ``n`` outputs, plus
        ``bias``: a new [m, n] tensor."""
        m, k = x.shape
        if x.dtype != self.dtype or x.stride(-1) != 1:
            raise TypeError(f"GEMM: {self.dtype} rows with contiguous columns, not {x.dtype}")
        if packed.numel() != self._elements(n, k) or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"GEMM: a weight packed for {n} x {k} (and a bias of {n})")
        out = x.new_empty(m, n)
        if bias is not None and (bias.dtype != self.dtype or not bias.is_contiguous()):
            bias = bias.to(self.dtype).contiguous()
        args = abi.GemmArgs(
            a=x.data_ptr(),
            lda=x.stride(0),
            m=m,
            k=k,
            packed=packed.data_ptr(),
            n=n,
            bias=None if bias is None else bias.data_ptr(),
            out=out.data_ptr(),
            ldc=n,
            threads=torch.get_num_threads(),
        )
        self._run(ctypes.byref(args))
        return out


@functools.cache
def sgemm() -> Gemm | None:
    """The compiled float32 :class:`Gemm`, or None where it cannot be built here or the CPU
    has no AVX-512 (there its tiles spill and oneDNN is faster)."""
    loaded = _load(
        "sgemm", lambda lib: (Gemm(lib, "batchd_sgemm", torch.float32), lib.batchd_sgemm_fast())
    )
    return loaded[0] if loaded is not None and loaded[1] else None


@functools.cache
def bgemm() -> Gemm | None:
    """The compiled bfloat16 :class:`Gemm`, or None where it cannot be built here or the CPU
    has no AVX-512 BF16 (nothing to run it on)."""
    loaded = _load(
        "bgemm", lambda lib: (Gemm(lib, "batchd_bgemm", torch.bfloat16), lib.batchd_bgemm_fast())
    )
    return loaded[0] if loaded is not None and loaded[1] else None


class LayerOps:
    """The work of a Llama layer between its matmuls (``layer_ops.c``), on torch's current
    number of intra-op threads. Every tensor of a call float32, or every one bfloat16 (cos/sin
    and the caches included), on the CPU, rows contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = abi.bind(lib, "batchd_rms_norm")
        self._rope = abi.bind(lib, "batchd_rope_store")
        self._silu = abi.bind(lib, "batchd_silu_mul")
        self._argmax = abi.bind(lib, "batchd_argmax")

    @staticmethod
    def takes_head_dim(head_dim: int) -> bool:
        """Whether the rotary embedding takes heads of ``head_dim`` (even, at most
        :data:`MAX_HEAD_DIM`)."""
        return head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM

    def rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``hidden += delta`` in place (``delta`` None: nothing added), then the RMS norm of
        ``hidden`` [rows, dim] times ``weight``, a new tensor."""
        rows, dim = hidden.shape
        _same_type("rms_norm", hidden, weight, *([] if delta is None else [delta]))
        _require(
            "rms_norm",
            hidden.is_contiguous()
            and weight.shape == (dim,)
            and weight.is_contiguous()
            and (delta is None or (delta.shape == hidden.shape and delta.stride(-1) == 1)),
            "hidden [rows, dim] contiguous, weight [dim], delta [rows, dim] with dim contiguous",
        )
        out = torch.empty_like(hidden)
        args = abi.NormArgs(
            hidden=hidden.data_ptr(),
            delta=None if delta is None else delta.data_ptr(),
            delta_row=0 if delta is None else delta.stride(0),
            weight=weight.data_ptr(),
            eps=eps,
            rows=rows,
            dim=dim,
            out=out.data_ptr(),
            threads=torch.get_num_threads(),
            bf16=int(hidden.dtype == torch.bfloat16),
        )
        self._norm(ctypes.byref(args))
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
        rows = qkv.shape[0]
        _same_type("rope_store", qkv, cos, sin, k_cache, v_cache)
        _require(
            "rope_store",
            qkv.dim() == 2
            and qkv.stride(-1) == 1
            and qkv.shape[1] == (heads + 2 * kv_heads) * dim
            and cos.shape == sin.shape == (rows, dim)
            and cos.is_contiguous()
            and sin.is_contiguous()
            and k_cache.is_contiguous()
            and v_cache.shape == k_cache.shape
            and v_cache.is_contiguous()
            and k_cache.shape[0] == kv_heads,
            "qkv [rows, (heads + 2 kv_heads) dim] with columns contiguous, cos and sin "
            "[rows, dim] contiguous, contiguous caches [kv_heads, blocks, block_size, dim]",
        )
        _indices("rope_store", slots, 1, rows)
        args = abi.RopeArgs(
            qkv=qkv.data_ptr(),
            qkv_row=qkv.stride(0),
            rows=rows,
            q_heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(),
            kv_head=k_cache.stride(0),
            slots=slots.data_ptr(),
            threads=torch.get_num_threads(),
            bf16=int(qkv.dtype == torch.bfloat16),
        )
        if self._rope(ctypes.byref(args)) != 0:
            raise ValueError(f"rope kernel: head_dim {dim} odd or over its {MAX_HEAD_DIM}")

    def silu_mul(self, gate_up: torch.Tensor, inner: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` [rows, 2 inner] (gate first), a new tensor."""
        rows = gate_up.shape[0]
        _same_type("silu_mul", gate_up)
        _require(
            "silu_mul",
            gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] >= 2 * inner,
            "gate_up [rows, 2 inner] with columns contiguous",
        )
        out = gate_up.new_empty(rows, inner)
        args = abi.SiluArgs(
            gate_up=gate_up.data_ptr(),
            gate_up_row=gate_up.stride(0),
            rows=rows,
            inner=inner,
            out=out.data_ptr(),
            threads=torch.get_num_threads(),
            bf16=int(gate_up.dtype == torch.bfloat16),
        )
        self._silu(ctypes.byref(args))
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of ``logits`` [rows, cols] (int64): the first largest, a
        NaN counting as largest."""
        _require(
            "argmax",
            logits.dtype == torch.float32
            and logits.device.type == "cpu"
            and logits.dim() == 2
            and logits.stride(-1) == 1,
            "float32 logits [rows, cols] on the CPU with columns contiguous",
        )
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._argmax(
            logits.data_ptr(), logits.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads()
        )
        return out


def _require(op: str, holds: bool, what: str) -> None:
    """A ValueError naming the call and what it takes, unless ``holds``."""
    if not holds:
        raise ValueError(f"{op}: takes {what}")


def _indices(op: str, t: torch.Tensor, dims: int, rows: int) -> None:
    """``t`` int64 on the CPU, ``dims``-dimensional, ``rows`` long, its last dimension
    contiguous (a block table, lengths or slots), or a ValueError."""
    _require(
        op,
        t.dtype == torch.int64
        and t.device.type == "cpu"
        and t.dim() == dims
        and t.shape[0] >= rows
        and t.stride(-1) == 1,
        f"int64 indices of {dims} dimension(s), {rows} rows at least, on the CPU",
    )


def _same_type(op: str, *tensors: torch.Tensor) -> None:
    """Every tensor float32 or every one bfloat16, on the CPU, or a TypeError naming them."""
    kinds = {(t.dtype, t.device.type) for t in tensors}
    if len(kinds) != 1 or next(iter(kinds)) not in {(d, "cpu") for d in _ELEMENT_TYPES}:
        raise TypeError(
            f"{op}: all float32 or all bfloat16 on the CPU, not {sorted(map(str, kinds))}"
        )


@functools.cache
def layer_ops() -> LayerOps | None:
    """The compiled :class:`LayerOps`, or None where they cannot be built here."""
    return _load("layer_ops", LayerOps)
