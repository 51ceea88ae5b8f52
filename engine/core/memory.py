"""How many KV blocks fit: the memory budget, from the device when there is one.

On an accelerator the KV cache gets ``kv_cache_memory`` (a fraction) of the device memory left
free after the weights and the activation peak of one profiling forward at
``max_num_batched_tokens`` (vLLM's recipe). On CPU a fraction applies to a fixed 1 GiB
(``DEFAULT_CPU_KV_BYTES``); an integer is bytes everywhere. What the compiled CPU kernels keep
between steps outside the cache (:func:`kernel_scratch_bytes`) comes off the budget too. The
arithmetic is kept apart from the measurement so it can be tested without a GPU. Why:
docs/engine.md ("The KV budget").
"""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Any

import torch

from engine.core.config import DEFAULT_CPU_KV_BYTES
from engine.cpu.kernels import PrefillKernel


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the KV cache. On the CPU its pages come from an anonymous mapping,
    which reads as zeros and takes memory only where written: the process holds the blocks its
    sequences have filled, not the whole budget from the start (``torch.zeros`` writes every
    page). The tensor keeps its mapping alive."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Loading a checkpoint converts every weight through temporary copies, and fusing
    and packing the linears replaces each weight with a new tensor: freed, those pages stay in
    the process (about 400 MB for SmolLM2 in bf16) until trimmed."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def drop_file_pages(tensors: list[torch.Tensor]) -> None:
    """Let the system reclaim the pages of ``tensors`` (weights no longer used: a layer's
    weight once its packed or fused copy replaced it) where they are a mapped checkpoint file.

    A float32 checkpoint loads as views of the safetensors file, mapped privately: the pages
    read while fusing and packing stay resident, counted in the process's memory, as long as
    the file stays mapped (the input embedding keeps it so). ``madvise(MADV_DONTNEED)`` on a
    clean private file mapping drops them; a later read would fault them in from the file again.
    Only whole pages inside a file mapping are touched, never the heap."""
    if not tensors or not hasattr(mmap, "PAGESIZE"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        lines = open("/proc/self/maps").read().splitlines()  # noqa: SIM115
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    files = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[4] != "0" and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            files.append((start, end))
    page = mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu" or not t.numel():
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if not any(start <= lo and hi <= end for start, end in files):
            continue
        first, last = -(-lo // page) * page, hi // page * page
        if last > first:
            madvise(first, last - first, _MADV_DONTNEED)


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def kv_budget_bytes(
    kv_cache_memory: int | float, *, free_bytes: int | None, activation_peak_bytes: int = 0
) -> int:
    """Bytes the KV cache may take.

    ``kv_cache_memory`` as an int is bytes, used as is. As a float it is a fraction of
    ``free_bytes`` (device memory free after the weights are loaded) less the activation peak
    of a profiling forward; ``free_bytes=None`` means no device pool (CPU), where the fraction
    applies to ``DEFAULT_CPU_KV_BYTES``.
    """
    if not isinstance(kv_cache_memory, float):
        return int(kv_cache_memory)
    if free_bytes is None:
        return int(DEFAULT_CPU_KV_BYTES * kv_cache_memory)
    return int(max(0, free_bytes - activation_peak_bytes) * kv_cache_memory)


def kernel_scratch_bytes(
    backend: Any, *, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Bytes the compiled CPU kernels keep between steps, outside the KV cache, while
    ``backend`` serves a model of this shape: the prefill kernel's tile of transposed keys
    (one stepping thread; float32 or bf16 on the CPU, what it attends), 0 where it is not
    used."""
    prefill = getattr(backend, "prefill", None)
    attended = dtype in (torch.float32, torch.bfloat16)
    if device.type != "cpu" or not attended or not isinstance(prefill, PrefillKernel):
        return 0
    return prefill.scratch_bound(kv_heads, head_dim)


def num_kv_blocks(
    budget_bytes: int,
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    describe: str = "",
) -> int:
    """Blocks that fit in ``budget_bytes``, capped at every sequence at full length (more
    would never be used). A budget that cannot hold one sequence of ``max_model_len`` is an
    error naming both figures: such an engine would refuse or endlessly preempt its longest
    requests."""
    per_seq = blocks_per_sequence(max_model_len, block_size)
    fits = budget_bytes // bytes_per_block
    if fits < per_seq:
        need = per_seq * bytes_per_block
        raise ValueError(
            f"the KV cache budget{describe} is {budget_bytes / 2**20:.1f} MiB "
            f"({fits} blocks of {block_size} tokens, {bytes_per_block} bytes each), but one "
            f"sequence of max_model_len {max_model_len} needs {per_seq} blocks "
            f"({need / 2**20:.1f} MiB): raise kv_cache_memory or lower max_model_len"
        )
    return int(min(fits, max_num_seqs * per_seq))


@torch.inference_mode()
def profile_activation_peak(
    model: Any, *, num_tokens: int, max_model_len: int, num_sampled: int, device: torch.device
) -> int:
    """Peak bytes above the resident weights of one forward over ``num_tokens`` packed tokens
    (positions restart every ``max_model_len``), logits for ``num_sampled`` rows included.

    The forward runs with transformers' "sdpa" attention ("eager" for a model without it),
    because the paged attention needs the cache this measurement sizes; the other activations
    (MLP, norms, logits) are those of the engine's step, and they dominate. Returns 0 where the device keeps no allocator
    statistics (CPU)."""
    previous = model.config._attn_implementation
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    positions = (torch.arange(num_tokens, device=device) % max_model_len).unsqueeze(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    base = getattr(model, model.base_model_prefix)
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # a model without an sdpa path: its eager attention (a larger peak)
        model.set_attn_implementation("eager")
    try:
        hidden = base(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        rows = hidden[0, -max(1, min(num_sampled, num_tokens)) :]
        model.get_output_embeddings()(rows).float()
        del hidden, rows
    finally:
        model.set_attn_implementation(previous)
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - resident
    torch.cuda.empty_cache()
    return int(max(0, peak))
