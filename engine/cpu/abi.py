"""The kernels' C interface for ctypes, written once: the argument structs and prototypes of
``csrc/batchd.h``, field for field (tests/engine/cpu/test_kernel_abi.py reads the header and
checks that they agree). :func:`bind` gives a library's function its prototype."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p
from typing import Any


class DecodeArgs(ctypes.Structure):
    _fields_ = [
        ("q", c_void_p),
        ("q_row", c_int64),
        ("q_head", c_int64),
        ("k", c_void_p),
        ("v", c_void_p),
        ("kv_head", c_int64),
        ("blocks", c_void_p),
        ("max_blocks", c_int64),
        ("lens", c_void_p),
        ("n", c_int32),
        ("heads", c_int32),
        ("kv_heads", c_int32),
        ("dim", c_int32),
        ("block_size", c_int32),
        ("window", c_int32),
        ("bf16", c_int32),
        ("scale", c_float),
        ("out", c_void_p),
        ("threads", c_int32),
    ]


class PrefillArgs(ctypes.Structure):
    _fields_ = [
        ("q", c_void_p),
        ("q_row", c_int64),
        ("q_head", c_int64),
        ("k", c_void_p),
        ("v", c_void_p),
        ("kv_head", c_int64),
        ("key_row", c_int64),
        ("blocks", c_void_p),
        ("block_size", c_int32),
        ("first_pos", c_int64),
        ("n_q", c_int32),
        ("heads", c_int32),
        ("kv_heads", c_int32),
        ("dim", c_int32),
        ("scale", c_float),
        ("out", c_void_p),
        ("out_row", c_int64),
        ("threads", c_int32),
        ("bf16", c_int32),
    ]


class GemmArgs(ctypes.Structure):
    _fields_ = [
        ("a", c_void_p),
        ("lda", c_int64),
        ("m", c_int32),
        ("k", c_int32),
        ("packed", c_void_p),
        ("n", c_int32),
        ("bias", c_void_p),
        ("out", c_void_p),
        ("ldc", c_int64),
        ("threads", c_int32),
    ]


class NormArgs(ctypes.Structure):
    _fields_ = [
        ("hidden", c_void_p),
        ("delta", c_void_p),
        ("delta_row", c_int64),
        ("weight", c_void_p),
        ("eps", c_float),
        ("rows", c_int32),
        ("dim", c_int32),
        ("out", c_void_p),
        ("threads", c_int32),
        ("bf16", c_int32),
    ]


class RopeArgs(ctypes.Structure):
    _fields_ = [
        ("qkv", c_void_p),
        ("qkv_row", c_int64),
        ("rows", c_int32),
        ("q_heads", c_int32),
        ("kv_heads", c_int32),
        ("dim", c_int32),
        ("cos", c_void_p),
        ("sin", c_void_p),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
        ("kv_head", c_int64),
        ("slots", c_void_p),
        ("threads", c_int32),
        ("bf16", c_int32),
    ]


class SiluArgs(ctypes.Structure):
    _fields_ = [
        ("gate_up", c_void_p),
        ("gate_up_row", c_int64),
        ("rows", c_int32),
        ("inner", c_int32),
        ("out", c_void_p),
        ("threads", c_int32),
        ("bf16", c_int32),
    ]


#: Each function of the header: (return type, argument types); None returns nothing.
PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "batchd_decode_attention": (c_int32, [POINTER(DecodeArgs)]),
    "batchd_prefill_attention": (c_int32, [POINTER(PrefillArgs)]),
    "batchd_prefill_attention_fast": (c_int32, []),
    "batchd_prefill_attention_bound": (c_int64, [c_int32, c_int32]),
    "batchd_prefill_attention_held": (c_int64, []),
    "batchd_prefill_attention_release": (None, []),
    "batchd_sgemm": (None, [POINTER(GemmArgs)]),
    "batchd_sgemm_pack": (None, [c_void_p, c_int32, c_int32, c_void_p]),
    "batchd_sgemm_fast": (c_int32, []),
    "batchd_bgemm": (None, [POINTER(GemmArgs)]),
    "batchd_bgemm_pack": (None, [c_void_p, c_int32, c_int32, c_void_p]),
    "batchd_bgemm_fast": (c_int32, []),
    "batchd_rms_norm": (None, [POINTER(NormArgs)]),
    "batchd_rope_store": (c_int32, [POINTER(RopeArgs)]),
    "batchd_silu_mul": (None, [POINTER(SiluArgs)]),
    "batchd_argmax": (None, [c_void_p, c_int64, c_int32, c_int64, c_void_p, c_int32]),
}

#: The struct each ``batchd_*_args`` typedef of the header is.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "batchd_decode_args": DecodeArgs,
    "batchd_prefill_args": PrefillArgs,
    "batchd_gemm_args": GemmArgs,
    "batchd_norm_args": NormArgs,
    "batchd_rope_args": RopeArgs,
    "batchd_silu_args": SiluArgs,
}


def bind(lib: ctypes.CDLL, name: str) -> Any:
    """``lib``'s function ``name`` with its prototype from :data:`PROTOTYPES`."""
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = PROTOTYPES[name]
    return fn
