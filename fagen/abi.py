"""The kernel ABI: a ctypes mirror of ``templates/include/fagen/params.h``.

A leaf module (no fagen imports) because both ends use it: codegen emits ``static_assert`` on
every offset computed here, and the runtime fills the struct to launch.
"""

from __future__ import annotations

import ctypes

# 2: the dQ accumulator's rows padded to contract.DQ_ACCUM_ROW_ALIGN per (batch, head).
# 3: window_left, window_right (the mask's band, contract.Mask).
# 4: the score modifiers (contract.Score): softcap_scale, alibi_slopes, alibi_batch_stride, sinks;
#    the backward's dsinks and sink_partials.
# 5: mask_args (a custom mask's device arguments).
# 6: FwdParams' serving fields (cu_seqlens_q ... lse_partial; contract.LAYOUTS).
# 7: cu_seqlens_k (FwdParams), cu_seqlens_q, cu_seqlens_k and total_q (BwdParams): the varlen
#    layout.
# 8: k_new, v_new, their strides and seqlen_new (FwdParams: a KV-cache call's append); MergeParams.
# 9: q_descale, k_descale, v_descale and their strides (FwdParams: the e4m3 element's descales).
ABI_VERSION = 9

_c_longlong = ctypes.c_longlong


def _strides(*tensors: str) -> list[tuple[str, type]]:
    return [(f"{t}_{dim}_stride", _c_longlong) for t in tensors for dim in ("batch", "row", "head")]


# The fields both structs end with: the LSE's strides and the problem's sizes, scale, mask, score
# modifiers and a custom mask's arguments.
_PROBLEM = [
    ("lse_batch_stride", _c_longlong),
    ("lse_head_stride", _c_longlong),
    ("batch", ctypes.c_int),
    ("heads_q", ctypes.c_int),
    ("heads_kv", ctypes.c_int),
    ("seqlen_q", ctypes.c_int),
    ("seqlen_k", ctypes.c_int),
    ("scale_log2", ctypes.c_float),
    ("window_left", ctypes.c_int),
    ("window_right", ctypes.c_int),
    ("softcap_scale", ctypes.c_float),
    ("alibi_slopes", ctypes.c_void_p),
    ("alibi_batch_stride", _c_longlong),
    ("sinks", ctypes.c_void_p),
    ("mask_args", ctypes.c_void_p),
]


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        *_strides("q", "k", "v", "o"),
        *_PROBLEM,
        ("cu_seqlens_q", ctypes.c_void_p),
        ("seqused_k", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("block_table_batch_stride", _c_longlong),
        ("page_size", ctypes.c_int),
        ("pages", ctypes.c_int),
        ("num_splits", ctypes.c_int),
        ("o_partial", ctypes.c_void_p),
        ("lse_partial", ctypes.c_void_p),
        ("cu_seqlens_k", ctypes.c_void_p),
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        *_strides("k_new", "v_new"),
        ("seqlen_new", ctypes.c_int),
        ("q_descale", ctypes.c_void_p),
        ("k_descale", ctypes.c_void_p),
        ("v_descale", ctypes.c_void_p),
        *[(f"{t}_descale_{dim}_stride", _c_longlong) for t in ("q", "k", "v") for dim in ("batch", "head")],
    ]


class BwdParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("dout", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("dq", ctypes.c_void_p),
        ("dk", ctypes.c_void_p),
        ("dv", ctypes.c_void_p),
        ("dq_accum", ctypes.c_void_p),
        ("softmax_d", ctypes.c_void_p),
        ("lse_log2", ctypes.c_void_p),
        ("dq_semaphore", ctypes.c_void_p),
        *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
        *_PROBLEM,
        ("softmax_scale", ctypes.c_float),
        ("dsinks", ctypes.c_void_p),
        ("sink_partials", ctypes.c_void_p),
        ("cu_seqlens_q", ctypes.c_void_p),
        ("cu_seqlens_k", ctypes.c_void_p),
        ("total_q", ctypes.c_int),
    ]


class MergeParams(ctypes.Structure):
    _fields_ = [
        ("out_a", ctypes.c_void_p),
        ("lse_a", ctypes.c_void_p),
        ("out_b", ctypes.c_void_p),
        ("lse_b", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        *_strides("out_a", "out_b", "out"),
        *[(f"lse_{t}_{dim}_stride", _c_longlong) for t in ("a", "b", "out") for dim in ("batch", "head")],
        ("batch", ctypes.c_int),
        ("seqlen", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
    ]


# The C name of each mirrored struct (params.h).
C_STRUCT_NAMES = {FwdParams: "FagenFwdParams", BwdParams: "FagenBwdParams", MergeParams: "FagenMergeParams"}
C_STRUCT_NAME = C_STRUCT_NAMES[FwdParams]


def field_offsets(struct: type[ctypes.Structure] = FwdParams) -> dict[str, int]:
    """Byte offset of every field, in declaration order."""
    return {name: getattr(struct, name).offset for name, _ in struct._fields_}


def struct_size(struct: type[ctypes.Structure] = FwdParams) -> int:
    return ctypes.sizeof(struct)
