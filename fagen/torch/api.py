"""flash_attn_func: flash-attn's calling convention on fagen's kernels, forward and backward.

The checks a call must pass before anything is traced or launched (options fagen does not
implement, the mask flag, the softmax scale), then the fastest route to the kernels: plain
eager calls go straight to the implementation (with an autograd.Function when a gradient is
recorded), traced calls (torch.compile, export, fake or other dispatch modes, tensor
subclasses) through the custom ops `fagen::flash_attn_fwd` / `fagen::flash_attn_bwd`, and for
float8_e4m3fn inputs `fagen::flash_attn_fwd_fp8` (forward only).
"""

from __future__ import annotations

import os

import torch

from .. import contract
from ..runtime import Bundle
from . import e4m3
from .adapter import (
    _flash_attn_fwd, _flash_attn_fwd_fp8, bundle_argument, eager_call, flash_attn_fwd, flash_attn_fwd_fp8,
)
from .backward import FlashAttention

# flash-attn's flash_attn_func options fagen does not implement, with the value that means "off":
# that value is accepted (it changes nothing), any other is refused rather than ignored.
_UNSUPPORTED_OPTIONS = {
    "dropout_p": (0.0, "fagen's kernels have no dropout"),
    "return_attn_probs": (False, "use return_lse=True for the log-sum-exp"),
}
# window_size's default, whose identity spares the default call the pair's checks.
_UNBOUNDED = (-1, -1)
# The arguments that are each a tensor or None, in the order the type check reads them.
_ARRAY_ARGUMENTS = ("alibi_slopes", "learnable_sink", "mask_args", *e4m3.DESCALE_NAMES)


def _check_options(extra_positional: tuple, options: dict) -> None:
    if extra_positional:
        raise TypeError(
            "fagen.flash_attn_func takes q, k and v positionally and everything else by keyword "
            f"(causal=..., softmax_scale=...); got {len(extra_positional)} more positional "
            "argument(s). flash-attn's 4th positional argument is dropout_p, which fagen does "
            "not support")
    for name, value in options.items():
        if name not in _UNSUPPORTED_OPTIONS:
            raise TypeError(f"fagen.flash_attn_func got an unexpected keyword argument {name!r}")
        off, why = _UNSUPPORTED_OPTIONS[name]
        if not _is_off(value, off):
            raise NotImplementedError(
                f"fagen.flash_attn_func: {name}={value!r} is not supported ({why}); only "
                f"{name}={off!r} is accepted")


def _check_window(window_size) -> None:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)):
        raise TypeError(f"fagen.flash_attn_func: window_size must be a pair of ints (left, right), "
                        f"got {window_size!r}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"fagen.flash_attn_func: window_size={tuple(window_size)}: each size must be "
                         ">= 0, or -1 for unbounded")


def _is_off(value, off) -> bool:
    if off is None or isinstance(off, bool):
        return value is off
    if isinstance(off, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == off
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == off


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *extra_positional,
    causal: bool = False,
    window_size: tuple[int, int] = _UNBOUNDED,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    mask_mod: str | None = None,
    mask_args: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    bundle: str | os.PathLike | Bundle | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    **flash_attn_options,
):
    """Attention in flash-attn's layout: q (batch, seqlen_q, nheads_q, head_dim), k (batch,
    seqlen_k, nheads_kv, head_dim) and v (batch, seqlen_k, nheads_kv, head_dim_v), fp16 or bf16
    on one CUDA device; differentiable in q, k and v. head_dim_v may differ from head_dim
    (DeepSeek-V3's 192/128; kernels built with head_dim_v). Everything after q, k, v is
    keyword-only.

    FP8: q, k and v all torch.float8_e4m3fn (OCP e4m3: 4 exponent and 3 mantissa bits, at most
    448 in magnitude) run the e4m3 kernels (Hopper, FA3; in the bundle as dtype: e4m3), forward
    only, with a bf16 output. Each tensor stores its values divided by a scale, and flash-attn's
    `q_descale`, `k_descale`, `v_descale` multiply them back: scores = q_descale * k_descale *
    softmax_scale * (q k^T of the stored values), out = v_descale * (P v). Each is a float32
    tensor on q's device of shape (batch, nheads_kv) (q's too: a query head takes the descale of
    the K/V head it reads), or of a shape that broadcasts to it ((), (1,) or (1, 1) for one
    value, (1, nheads_kv), (batch, 1)), or None for 1.0; used in place, views included, so a
    CUDA graph replays with the values they hold then. causal and window_size work as for bf16;
    softcap, alibi_slopes, learnable_sink and mask_mod do not (yet), nor do inputs that require
    grad. The descales are refused with fp16/bf16 inputs.

    nheads_q must be a multiple of nheads_kv (GQA/MQA; dk, dv are summed over the query heads a
    K/V head serves). `causal` (a bool) masks bottom-right aligned (query row i sees keys
    j <= i + seqlen_k - seqlen_q, as flash-attn >= 2.1); a row that sees no key gives zeros, LSE
    -inf and zero gradients. `window_size` = (left, right) is flash-attn's sliding window: row i
    sees keys i + seqlen_k - seqlen_q - left ... i + seqlen_k - seqlen_q + right, -1 (or a size
    >= seqlen_k) unbounded, right = 0 under causal; the time follows the window, not seqlen_k
    (local kernels, in the bundle as mask: local). `softmax_scale` defaults to 1/sqrt(head_dim); any finite scale >= 0
    works (0: uniform attention over the keys a row sees); negative, inf and NaN are refused.
    `softcap` > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma-2), with its
    derivative in the backward. `alibi_slopes`, float (nheads,) or (batch, nheads), adds
    -slope * |i + seqlen_k - seqlen_q - j| to the scaled scores (flash-attn's ALiBi; the slopes
    get no gradient). `learnable_sink`, float (nheads,), is a logit per query head that joins
    every row's softmax denominator and adds nothing to the output (gpt-oss's sinks), with its
    gradient. Each is a kernel variant (score: softcap / alibi / sinks in the spec).
    `mask_mod` names a custom mask a bundle was built with (a spec's `masks:`: a CUDA header,
    compiled in ahead of time), `mask_args` the device tensor its type reads (e.g. each token's
    document id); it replaces causal and window_size, and the deterministic mode is refused with
    it.
    `deterministic` makes the backward sum dQ in a fixed order (the same gradients, bit for bit,
    on every run; slower). `bundle` is a bundle directory or a loaded Bundle; default
    $FAGEN_BUNDLE, else fagen's default bundle. flash-attn's dropout_p and return_attn_probs are
    accepted only at their "off" values.

    Returns out (batch, seqlen_q, nheads_q, head_dim_v) in q's dtype (bf16 for e4m3 inputs),
    plus, with return_lse, the natural-log LSE (batch, nheads_q, seqlen_q) in float32 (not
    differentiable).
    """
    if extra_positional or flash_attn_options:
        _check_options(extra_positional, flash_attn_options)
    if not isinstance(causal, bool):
        raise TypeError(f"fagen.flash_attn_func: causal must be True or False, got {causal!r}")
    if window_size is not _UNBOUNDED:
        _check_window(window_size)
    window_left, window_right = window_size
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"fagen.flash_attn_func: softcap must be a number, got {softcap!r}")
    softcap = float(softcap)
    if mask_mod is not None and not isinstance(mask_mod, str):
        raise TypeError(f"fagen.flash_attn_func: mask_mod must be a custom mask's name or None, got {mask_mod!r}")
    if mask_mod is not None and deterministic:
        raise NotImplementedError("fagen.flash_attn_func: deterministic=True takes the built-in masks only "
                                  f"(mask_mod={mask_mod!r})")
    descales = (q_descale, k_descale, v_descale)
    for name, array in zip(_ARRAY_ARGUMENTS, (alibi_slopes, learnable_sink, mask_args, *descales)):
        if array is not None and not isinstance(array, torch.Tensor):
            raise TypeError(f"fagen.flash_attn_func: {name} must be a tensor or None, got {type(array).__name__}")
    if softcap:  # 0.0, no softcap, is valid: spares the check a microsecond
        try:
            contract.Score(softcap)
        except contract.ScoreError as error:
            raise ValueError(f"fagen.flash_attn_func: {error}") from None
    if not isinstance(deterministic, bool):
        raise TypeError(f"fagen.flash_attn_func: deterministic must be True or False, got "
                        f"{deterministic!r}")
    bundle = bundle_argument(bundle)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"fagen.flash_attn_func: softmax_scale must be a number or None, got "
                            f"{softmax_scale!r}")
        softmax_scale = float(softmax_scale)
        contract.kernel_scale_log2(softmax_scale, q.shape[-1])  # refused before tracing or launch
    if e4m3.is_fp8_call(q, k, v, descales):
        e4m3.check_fp8_call(q, k, v, {
            "softcap": softcap > 0, "alibi_slopes": alibi_slopes is not None,
            "learnable_sink": learnable_sink is not None, "mask_mod": mask_mod is not None,
            "mask_args": mask_args is not None})
        forward = _flash_attn_fwd_fp8 if eager_call(q, k, v, *descales) else flash_attn_fwd_fp8
        out, lse = forward(q, k, v, *descales, causal, window_left, window_right, softmax_scale, bundle)
        return (out, lse) if return_lse else out
    options = (causal, window_left, window_right, softcap, softmax_scale, bundle, deterministic, mask_mod, mask_args)
    if not eager_call(q, k, v, alibi_slopes, learnable_sink, mask_args):
        out, lse = flash_attn_fwd(q, k, v, alibi_slopes, learnable_sink, *options)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                      or (learnable_sink is not None and learnable_sink.requires_grad)):
        out, lse = FlashAttention.apply(q, k, v, alibi_slopes, learnable_sink, options)
    else:
        out, lse = _flash_attn_fwd(q, k, v, alibi_slopes, learnable_sink, *options)
    return (out, lse) if return_lse else out
