"""The kernel ABI: a ctypes mirror of ``templates/include/fagen/params.h``.

A leaf module (no fagen imports) because both ends use it: codegen emits ``static_assert`` on
every offset computed here, and the runtime fills the struct to launch.
"""

from __future__ import annotations

import ctypes

ABI_VERSION = 1

_c_longlong = ctypes.c_longlong


class FwdParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("q_batch_stride", _c_longlong),
        ("q_row_stride", _c_longlong),
        ("q_head_stride", _c_longlong),
        ("k_batch_stride", _c_longlong),
        ("k_row_stride", _c_longlong),
        ("k_head_stride", _c_longlong),
        ("v_batch_stride", _c_longlong),
        ("v_row_stride", _c_longlong),
        ("v_head_stride", _c_longlong),
        ("o_batch_stride", _c_longlong),
        ("o_row_stride", _c_longlong),
        ("o_head_stride", _c_longlong),
        ("lse_batch_stride", _c_longlong),
        ("lse_head_stride", _c_longlong),
        ("batch", ctypes.c_int),
        ("heads_q", ctypes.c_int),
        ("heads_kv", ctypes.c_int),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_k", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
    ]


C_STRUCT_NAME = "FagenFwdParams"


def field_offsets() -> dict[str, int]:
    """Byte offset of every field, in declaration order."""
    return {name: getattr(FwdParams, name).offset for name, _ in FwdParams._fields_}


def struct_size() -> int:
    return ctypes.sizeof(FwdParams)
