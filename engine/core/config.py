"""Engine configuration: one slotted dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB on CPU unless told otherwise

# The running-set cap when ``max_num_seqs`` is not given, by device type. On an accelerator a
# decode step is bound by reading the weights, so 128 sequences cost little more than one. On
# a CPU too a decode step is mostly matmul (the decode rows attend together) and partly bound
# by streaming the weights from memory (SmolLM2's 270 MB in bf16, past the caches, every
# step), so more rows per step pay: SmolLM2 in bf16 makes 12-15% more tokens per CPU-second
# at 64 than at 32 sequences (64 chat requests) and 14% more at 128 than at 64 (200 requests;
# ``benchmarks.engine --workload chat``). More only lengthens every step, and the wait of any
# small job that shares the engine.
DEFAULT_MAX_NUM_SEQS = {"cpu": 128}
DEFAULT_MAX_NUM_SEQS_ACCELERATOR = 128


#: The values of EngineConfig's string options; __post_init__ reads the allowed ones from here.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Admission = Literal["batch", "fcfs"]
AttentionBackend = Literal["auto", "sdpa", "flex"]
#: The packings of EngineConfig.cpu_gemm (engine/cpu/linear.py).
CpuGemm = Literal["auto", "plain", "onednn", "mkl", "batchd"]


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model.

    ``kv_cache_memory`` is bytes (int) or a fraction (float in (0, 1]) of the accelerator
    memory left free by the weights and by the activation peak of a profiling forward at
    ``max_num_batched_tokens`` (engine/core/memory.py); on CPU a fraction applies to 1 GiB. ``num_kv_blocks``,
    when set, overrides the memory budget. ``admission`` orders waiting requests: "batch"
    groups shared prefixes and starts long work first, "fcfs" keeps arrival order.
    ``attention_backend``: "sdpa" (one call per sequence, fastest on CPU), "flex" (one
    FlexAttention call per layer per step over the paged cache, for CUDA) or "auto" (sdpa on
    CPU, flex on CUDA). ``cuda_graphs``: capture decode-only steps as CUDA graphs at bucketed
    batch sizes up to ``cuda_graph_max_batch`` (flex backend on CUDA only; ignored elsewhere).
    ``max_num_seqs`` left as None is chosen by the device (:meth:`for_device`): 128 on a
    CPU and on an accelerator. ``dtype`` "auto" is bf16 on an accelerator and on a CPU that
    multiplies bf16 natively (AMX or AVX-512 BF16), float32 on other CPUs.
    """

    dtype: Dtype = "auto"
    device: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | float = 0.85
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    admission: Admission = "batch"
    seed: int = 0
    attention_backend: AttentionBackend = "auto"
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    enable_metrics: bool = True  # per-step and per-request histograms (engine/core/stats.py)
    # On a CPU, size torch's intra-op threads to the cores other processes leave free
    # (engine/threads/governor.py): on by default, for the library as for the worker, because two
    # threads on cores that others hold spin at every barrier; off keeps the threads torch
    # was given. Never above the team torch had when the engine started.
    adapt_cpu_threads: bool = True
    # On a CPU, the compiled kernels (engine/cpu/kernels.py), for float32 and bf16: decode and
    # prefill attention reading the paged cache in place, the lean forward's layer ops (norm,
    # rotary with the cache write, SiLU product), the greedy argmax, and the GEMMs the linear
    # layers may be packed for (cpu_gemm). Prefill attention and the float32 GEMM are used only
    # where the CPU has AVX-512, the bf16 GEMM where it has AVX-512 BF16. Off, or where no C
    # compiler is found, every one of them gives way to torch's operators.
    cpu_kernels: bool = True
    # On a CPU, the library the linear layers' weights are packed for: "auto" (the compiled
    # GEMM where it is built for the weights' dtype, float32 with AVX-512 or bf16 with AVX-512
    # BF16, as its rows do not depend on the step; else bf16: oneDNN, float32: the one this
    # machine recorded as fastest the first time it loaded the shape; engine/cpu/linear.py),
    # or forced: "plain", "onednn", "mkl" (float32 only) or "batchd" (the compiled GEMM, float32
    # or bf16, where it is built).
    cpu_gemm: CpuGemm = "auto"
    # LoRA adapters (engine/lora): name -> the directory peft saved it to, checked against the
    # model at start (``Engine.add_lora`` registers more later). At most ``max_loras`` are
    # resident at once (their memory comes off the KV budget), none of rank above
    # ``max_lora_rank``.
    lora_adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        dtypes = get_args(Dtype)
        if self.dtype not in dtypes:
            raise ValueError(
                f"dtype must be one of {', '.join(map(repr, dtypes))}, got {self.dtype!r}"
            )
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.max_num_seqs is not None:
            _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("block_size", self.block_size)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024, got {self.block_size}")
        kv = self.kv_cache_memory
        if isinstance(kv, bool) or not isinstance(kv, int | float):
            raise ValueError(
                f"kv_cache_memory must be bytes (int) or a fraction (float), got {kv!r}"
            )
        if isinstance(kv, float) and not 0.0 < kv <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv}")
        if isinstance(kv, int) and kv < 1:
            raise ValueError(f"kv_cache_memory in bytes must be >= 1, got {kv}")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.admission not in get_args(Admission):
            raise ValueError(
                f"admission must be {_either(get_args(Admission))}, got {self.admission!r}"
            )
        if self.attention_backend not in get_args(AttentionBackend):
            raise ValueError(
                f"attention_backend must be {_either(get_args(AttentionBackend))}, "
                f"got {self.attention_backend!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if not isinstance(self.cpu_kernels, bool):
            raise ValueError(f"cpu_kernels must be true or false, got {self.cpu_kernels!r}")
        gemms = get_args(CpuGemm)
        if self.cpu_gemm not in gemms:
            raise ValueError(
                f"cpu_gemm must be one of {', '.join(map(repr, gemms))}, got {self.cpu_gemm!r}"
            )
        _positive_int("cuda_graph_max_batch", self.cuda_graph_max_batch)
        if not isinstance(self.enable_metrics, bool):
            raise ValueError(f"enable_metrics must be true or false, got {self.enable_metrics!r}")
        if not isinstance(self.adapt_cpu_threads, bool):
            raise ValueError(
                f"adapt_cpu_threads must be true or false, got {self.adapt_cpu_threads!r}"
            )
        if not isinstance(self.lora_adapters, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str | os.PathLike)
            for k, v in self.lora_adapters.items()
        ):
            raise ValueError(
                f"lora_adapters must map adapter names to directories, got {self.lora_adapters!r}"
            )
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def resolved_max_num_seqs(self) -> int:
        """``max_num_seqs`` as chosen by :meth:`for_device` (or given): the engine's config
        always has one; a config not yet made for a device has none to give."""
        if self.max_num_seqs is None:
            raise ValueError("max_num_seqs is chosen by the device: use for_device() first")
        return self.max_num_seqs

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the choices left to the device made (``max_num_seqs``)."""
        if self.max_num_seqs is not None:
            return self
        seqs = DEFAULT_MAX_NUM_SEQS.get(device_type, DEFAULT_MAX_NUM_SEQS_ACCELERATOR)
        return dataclasses.replace(self, max_num_seqs=seqs)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown name is an error that lists the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"unknown engine config field(s) {unknown}; known fields: {sorted(names)}"
            )
        return cls(**kwargs)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _either(values: tuple[str, ...]) -> str:
    """``'a', 'b' or 'c'``: the allowed values of an option, as its error message lists them."""
    quoted = [repr(v) for v in values]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"
