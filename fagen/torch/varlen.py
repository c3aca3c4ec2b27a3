"""flash_attn_varlen_func: flash-attn's call over sequences of different lengths packed into one
tensor, on fagen's varlen-layout kernels (contract.LAYOUTS), forward and backward; with a block
table, vLLM's call over a paged KV cache (fagen.torch.kvcache). Eager calls run the kernels
directly (an autograd.Function when a gradient is recorded); traced ones (torch.compile, fake or
other dispatch modes) go through the custom ops `fagen::flash_attn_varlen_fwd` / `_bwd`.

No host synchronisation: the grid follows max_seqlen_q / max_seqlen_k, each sequence's lengths
are read on the device from cu_seqlens, and tiles past a sequence's end do no work.
"""

# No `from __future__ import annotations`: torch.library reads the ops' annotations as objects.
import math
from typing import Optional

import torch

from .. import contract
from ..runtime import call as runtime_call
from ..runtime import driver
from ..runtime.prepared import BackwardPointers, prepare_backward
from .adapter import (
    _DTYPE_NAMES, _current_stream, _score_arrays, bundle_argument, define_op, eager_call, get_bundle,
)
from .backward import _backward_arrays, enqueue_backward

_NAME = "fagen.flash_attn_varlen_func"


def _fail(message: str, error: type[Exception] = ValueError) -> Exception:
    return error(f"{_NAME}: {message}")


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` (total, heads, head_dim) with a contiguous last dimension, 16-byte aligned rows and
    strides in multiples of 8 elements (params.h); a copy when it has not."""
    if t.dim() != 3:
        raise _fail(f"{name} must be 3-D (total_tokens, nheads, head_dim), got shape {tuple(t.shape)}")
    ready = (t.stride(2) == 1 and t.data_ptr() % contract.ALIGNMENT_BYTES == 0
             and all(s % contract.STRIDE_MULTIPLE == 0 and s > 0 for s in t.stride()[:2]))
    return t if ready else t.contiguous()


def _tensor(t: torch.Tensor) -> runtime_call.Tensor:
    return runtime_call.Tensor(t.data_ptr(), 0, t.stride(0), t.stride(1))


def _offsets(t, name: str, device, batch: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device or t.dim() != 1:
        raise _fail(f"{name} must be a 1-D int32 tensor on {device}", TypeError)
    if batch is not None and t.numel() != batch:
        raise _fail(f"{name} has {t.numel()} entries, cu_seqlens_q {batch}: one per sequence (+ 1)")
    return t.contiguous()


def _problem(q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, window, softcap, alibi, sinks):
    head_dim, head_dim_v = q.shape[2], v.shape[2]
    return runtime_call.Problem(
        _DTYPE_NAMES[q.dtype], causal, batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], head_dim,
        tuple(window), contract.Score(softcap, alibi, sinks), None if head_dim_v == head_dim else head_dim_v,
        layout="varlen")


def _check(q, k, v, batch, alibi_slopes, learnable_sink) -> None:
    if q.dtype not in _DTYPE_NAMES:
        raise _fail(f"q has dtype {q.dtype}; supported: float16, bfloat16", TypeError)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}", TypeError)
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        raise _fail(f"q, k, v must be CUDA tensors on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[2]:
        raise _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (total_k, nheads_kv), and k "
                    f"with q {tuple(q.shape)} on head_dim")
    heads = q.shape[1]
    if alibi_slopes is not None and alibi_slopes.shape not in ((heads,), (batch, heads)):
        raise _fail(f"alibi_slopes must be (nheads,) = ({heads},) or (batch, nheads) = ({batch}, {heads})")
    if learnable_sink is not None and learnable_sink.shape != (heads,):
        raise _fail(f"learnable_sink must be (nheads,) = ({heads},)")


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
             window, softmax_scale, softcap, alibi_slopes, learnable_sink, bundle):
    batch = cu_seqlens_q.numel() - 1
    q, k, v = _rows(q, "q"), _rows(k, "k"), _rows(v, "v")
    problem = _problem(q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                       alibi_slopes is not None, learnable_sink is not None)
    out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0:
        return out, lse
    if max_seqlen_k == 0:  # no keys anywhere: the result of a row that sees nothing
        out.zero_()
        lse.fill_(-math.inf) if learnable_sink is None else lse.copy_(
            learnable_sink.to(torch.float32).view(-1, 1).expand_as(lse))
        return out, lse
    kernels = get_bundle(bundle)
    device = q.device.index
    arrays, _kept = _score_arrays(alibi_slopes, learnable_sink)
    varlen = runtime_call.Varlen(cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), q.shape[0], k.shape[0],
                                 0 if seqused_k is None else seqused_k.data_ptr())
    with driver.primary_context(device):
        prepared = runtime_call.prepare(kernels, problem, _tensor(q), _tensor(k), _tensor(v), _tensor(out),
                                        softmax_scale, device, score_tensors=arrays, varlen=varlen)
        prepared.enqueue(out.data_ptr(), lse.data_ptr(), _current_stream(device))
    return out, lse


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
              window, softmax_scale, softcap, alibi_slopes, learnable_sink, deterministic, bundle):
    batch = cu_seqlens_q.numel() - 1
    q, k, v, out = _rows(q, "q"), _rows(k, "k"), _rows(v, "v"), _rows(out, "out")
    # Zeros: rows outside every sequence (past cu_seqlens[-1]) get no gradient from the kernels.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsink = torch.zeros(0 if learnable_sink is None else q.shape[1], dtype=torch.float32, device=q.device)
    if max_seqlen_k == 0 or max_seqlen_q == 0 or batch == 0 or q.numel() == 0:
        return dq, dk, dv, dsink
    problem = _problem(q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, window, softcap,
                       alibi_slopes is not None, learnable_sink is not None)
    device = q.device.index
    kernels = get_bundle(bundle)
    dout = _rows(dout, "dout")
    with driver.primary_context(device):
        tensors = runtime_call.BackwardTensors(
            q=_tensor(q), k=_tensor(k), v=_tensor(v), out=_tensor(out), dout=_tensor(dout),
            dq=_tensor(dq), dk=_tensor(dk), dv=_tensor(dv), lse=lse.data_ptr())
        varlen = runtime_call.Varlen(cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), q.shape[0], k.shape[0])
        arrays, _copies = _backward_arrays(alibi_slopes, learnable_sink, None, dsink)  # alive until enqueued
        prepared = prepare_backward(kernels, problem, tensors, deterministic=deterministic, softmax_scale=softmax_scale,
                                    device=device, score_tensors=arrays, varlen=varlen)
        enqueue_backward(prepared, BackwardPointers.of(tensors), arrays, q.device, varlen)
    return dq, dk, dv, dsink


def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                learnable_sink: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                window_left: int, window_right: int, softmax_scale: Optional[float], softcap: float,
                deterministic: bool, bundle: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """out, lse; `deterministic` is the backward's, saved for it by the op's autograd."""
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                    (window_left, window_right), softmax_scale, softcap, alibi_slopes, learnable_sink, bundle)


def _op_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                 alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor], max_seqlen_q: int,
                 max_seqlen_k: int, causal: bool, window_left: int, window_right: int,
                 softmax_scale: Optional[float], softcap: float, deterministic: bool,
                 bundle: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dL/dsink (fp32 (nheads,); empty without sinks)."""
    return _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     (window_left, window_right), softmax_scale, softcap, alibi_slopes, learnable_sink, deterministic,
                     bundle)


def _op_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, max_seqlen_q,
                     max_seqlen_k, causal, window_left, window_right, softmax_scale, softcap, deterministic, bundle):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _op_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, *options):
    dsink = q.new_empty(0 if learnable_sink is None else q.shape[1], dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


flash_attn_varlen_fwd = define_op("flash_attn_varlen_fwd", _op_forward, _op_forward_fake)
# No autograd of its own (no double backward), as the dense backward op.
flash_attn_varlen_bwd = define_op("flash_attn_varlen_bwd", _op_backward, _op_backward_fake)


def _input_grads(ctx, grads, learnable_sink) -> tuple:
    """The gradients of the op's (and the eager Function's) inputs: dq, dk, dv (inputs 0-2) and
    dsink in the sink's dtype (input 7) where autograd needs them, None for the rest."""
    dq, dk, dv, dsink = grads
    needed = ctx.needs_input_grad
    dsink = None if learnable_sink is None or not needed[7] else dsink.to(learnable_sink.dtype)
    return (dq if needed[0] else None, dk if needed[1] else None, dv if needed[2] else None, None, None, None, None,
            dsink, *(None,) * len(ctx.options))


def _op_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, _seqused_k, alibi_slopes, learnable_sink, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink)
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(lse)


def _op_autograd(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink = ctx.saved_tensors
    grads = flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink,
                                  *ctx.options)
    return _input_grads(ctx, grads, learnable_sink)


torch.library.register_autograd("fagen::flash_attn_varlen_fwd", _op_autograd, setup_context=_op_setup_context)


class _VarlenAttention(torch.autograd.Function):
    """The eager path's autograd: the op's kernels without the dispatcher."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, *options):
        out, lse = _op_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, *options)
        _op_setup_context(ctx, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink,
                                *options), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink = ctx.saved_tensors
        grads = _op_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink,
                             *ctx.options)
        return _input_grads(ctx, grads, learnable_sink)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    seqused_k: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    bundle=None,
):
    """Attention over a batch of sequences of different lengths, packed (flash-attn's names and
    semantics): q (total_q, nheads_q, d), k (total_k, nheads_kv, d), v (total_k, nheads_kv, d_v);
    cu_seqlens_q, cu_seqlens_k int32 (batch + 1) offsets of each sequence's tokens on q's
    device; max_seqlen_q / max_seqlen_k at least each sequence's length (they size the grid:
    exact values cost nothing, larger ones idle CTAs). Each sequence attends within itself,
    `causal` aligned to its last key (bottom-right), `window_size`, `softcap`, `alibi_slopes`,
    `learnable_sink` and `deterministic` as in fagen.flash_attn_func; differentiable in q, k, v
    (and the sink). seqused_k (int32 (batch,), forward only) caps each sequence's keys.

    With block_table (vLLM's call): k and v are a paged KV cache (num_pages, page_size,
    nheads_kv, d), cu_seqlens_k must be None and seqused_k gives each sequence's cached keys;
    it runs fagen.flash_attn_with_kvcache (no gradient), which also takes an FP8 cache with its
    q_descale, k_descale and v_descale.

    Returns out (total_q, nheads_q, d_v) and, with return_lse, the natural-log LSE (nheads_q,
    total_q) in float32. dropout_p and return_attn_probs only at their off values.
    """
    if dropout_p != 0.0:
        raise _fail("dropout_p is not supported (fagen's kernels have no dropout)", NotImplementedError)
    if return_attn_probs:
        raise _fail("return_attn_probs is not supported; use return_lse=True for the log-sum-exp",
                    NotImplementedError)
    if not isinstance(causal, bool):
        raise _fail(f"causal must be True or False, got {causal!r}", TypeError)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(f"{name} must be an int >= 0, got {value!r}", TypeError)
    window = tuple(window_size)
    if len(window) != 2 or min(window) < -1:
        raise _fail(f"window_size={window_size!r}: (left, right), each >= 0 or -1 for unbounded")
    cu_seqlens_q = _offsets(cu_seqlens_q, "cu_seqlens_q", q.device)
    if block_table is not None:
        if cu_seqlens_k is not None:
            raise _fail("with block_table, k and v are a paged cache: give seqused_k (each sequence's "
                        "cached keys), not cu_seqlens_k")
        from .kvcache import flash_attn_with_kvcache

        return flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqused_k, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal, window_size=window,
            softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, return_lse=return_lse,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, bundle=bundle)
    if any(t is not None for t in (q_descale, k_descale, v_descale)):
        raise _fail("q_descale, k_descale and v_descale are for an FP8 KV cache (with block_table); packed "
                    "varlen q, k, v are float16 or bfloat16", NotImplementedError)
    if cu_seqlens_k is None:
        raise _fail("cu_seqlens_k is needed without a block_table")
    batch = cu_seqlens_q.numel() - 1
    cu_seqlens_k = _offsets(cu_seqlens_k, "cu_seqlens_k", q.device, batch + 1)
    if seqused_k is not None:
        seqused_k = _offsets(seqused_k, "seqused_k", q.device, batch)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise _fail(f"{name} must be 3-D (total_tokens, nheads, head_dim), got shape {tuple(t.shape)}")
    _check(q, k, v, batch, alibi_slopes, learnable_sink)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    if not isinstance(deterministic, bool):
        raise _fail(f"deterministic must be True or False, got {deterministic!r}", TypeError)
    bundle = bundle_argument(bundle)
    arguments = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, max_seqlen_q,
                 max_seqlen_k, causal, window[0], window[1], softmax_scale, float(softcap), deterministic, bundle)
    wants_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (learnable_sink is not None and learnable_sink.requires_grad))
    if wants_grad and seqused_k is not None:
        raise _fail("seqused_k has no backward (give each sequence's keys through cu_seqlens_k)",
                    NotImplementedError)
    eager = eager_call(*arguments[:8])
    if not eager:
        out, lse = flash_attn_varlen_fwd(*arguments)
    elif wants_grad:
        out, lse = _VarlenAttention.apply(*arguments)
    else:
        out, lse = _op_forward(*arguments)
    return (out, lse) if return_lse else out
