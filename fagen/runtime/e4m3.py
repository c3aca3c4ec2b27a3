"""The e4m3 (FP8) element at run time: the descales its kernels read, and the calls they take.

An e4m3 tensor stores its values divided by a scale, and its descale multiplies them back. The
e4m3 kernels fold q's and k's descales into the softmax scale (scores = q_descale * k_descale *
softmax_scale * Q K^T of the stored values) and apply v's to the output (out = v_descale * P V),
as flash-attn's Hopper interface does; the output is bf16 (contract.output_dtype). Each descale
is an fp32 device array read at [b * batch_stride + kv_head * head_stride] (kv_head: the K/V
head that a query head reads; flash-attn's descales are (batch, nheads_kv), q's too); strides 0
broadcast a single value, and a null address is 1.0 (FagenFwdParams q_descale ...).

An e4m3 KV cache under fp16 / bf16 queries (a paged-layout call's kv_dtype, contract.CACHE_DTYPES)
takes the same descales: k's and v's for the cache, q's where the queries were scaled too; its
output is the queries' type.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import contract

E4M3 = "e4m3"
# What the first e4m3 kernels are (fagen/model/fa3.py: Fa3ForwardSpec's e4m3 rule): FA3
# forwards of the dense layout with a built-in mask and no score modifier.
E4M3_LAYOUTS = ("dense",)
_TENSORS = ("q", "k", "v")
_DIMS = ("batch", "head")


@dataclass(frozen=True)
class Descales:
    """The descales of one e4m3 call: each tensor's fp32 array address (0: a descale of 1.0)
    and its (batch, head) strides in floats (0: the same value for every batch row or head)."""

    q: int = 0
    k: int = 0
    v: int = 0
    q_batch_stride: int = 0
    q_head_stride: int = 0
    k_batch_stride: int = 0
    k_head_stride: int = 0
    v_batch_stride: int = 0
    v_head_stride: int = 0

    def params_fields(self) -> dict:
        """FagenFwdParams' descale fields (params.h), as FwdParams takes them."""
        fields = {f"{t}_descale": getattr(self, t) or None for t in _TENSORS}
        fields.update({f"{t}_descale_{dim}_stride": getattr(self, f"{t}_{dim}_stride")
                       for t in _TENSORS for dim in _DIMS})
        return fields


def descales_problem(dtype: str, descales: Descales | None, kv_dtype: str | None = None) -> str | None:
    """Why a call of element `dtype` (and K/V cache element `kv_dtype`, None: dtype) cannot take
    `descales`, or None. Only calls with e4m3 elements have descales (an empty Descales is
    none); an address must be 4-byte aligned (an fp32 array), a stride >= 0."""
    if descales is None or descales == Descales():
        return None
    if E4M3 not in (dtype, kv_dtype):
        return (f"descales: for e4m3 problems only; a {dtype} problem's elements are its values "
                "(give the call no descales)")
    for t in _TENSORS:
        address = getattr(descales, t)
        if address % 4:
            return (f"descales.{t}={address:#x}: a 4-byte aligned fp32 device array, or 0 for a "
                    "descale of 1.0")
        for dim in _DIMS:
            stride = getattr(descales, f"{t}_{dim}_stride")
            if stride < 0:
                return (f"descales.{t}_{dim}_stride={stride}: must be >= 0 (in floats; 0 gives "
                        "every index the same value)")
    return None


def cache_problem(dtype: str, kv_dtype: str, layout: str) -> str | None:
    """Why no kernel reads a K/V cache of element `kv_dtype` under queries of `dtype` (they
    differ), or None."""
    if kv_dtype not in contract.CACHE_DTYPES:
        return (f"kv_dtype {kv_dtype!r}: k and v are q's type ({dtype}) or, in a KV cache, "
                f"{' or '.join(contract.CACHE_DTYPES)}")
    if layout != "paged":
        return (f"kv_dtype {kv_dtype}: a K/V element other than q's is a KV cache's (the paged layout, "
                f"flash_attn_with_kvcache), not the {layout} layout's")
    if dtype not in ("fp16", "bf16"):
        return (f"kv_dtype {kv_dtype} under {dtype} queries: the cache kernels take fp16 or bf16 "
                "queries (e4m3 queries convert to bf16 exactly; their q_descale still applies)")
    return None


def call_problem(direction: str, layout: str, mods: tuple[str, ...], mask_mod: str | None) -> str | None:
    """Why no e4m3 kernel serves a call of this direction, layout, score modifiers and custom
    mask, or None. Said before the bundle lookup, whose KernelNotFound would suggest a
    `fagen build` of a kernel that the spec models refuse."""
    if direction != "fwd":
        return ("dtype e4m3: fagen's FP8 kernels are forward kernels; there is no e4m3 backward "
                "(train in fp16 or bf16)")
    if layout not in E4M3_LAYOUTS:
        return (f"dtype e4m3: the e4m3 kernels take the {' and '.join(E4M3_LAYOUTS)} layout, not "
                f"{layout!r}")
    if mods:
        return (f"dtype e4m3: the e4m3 kernels take no score modifier ({', '.join(mods)} asked "
                f"for; fp16 and bf16 kernels take {', '.join(contract.SCORE_MODS)})")
    if mask_mod is not None:
        return f"dtype e4m3: the e4m3 kernels take the built-in masks only, not mask_mod={mask_mod!r}"
    return None
