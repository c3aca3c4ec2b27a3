"""The backward of flash_attn_func: the custom op ``fagen::flash_attn_bwd`` (with its fake
implementation), the autograd of the forward op, and the autograd.Function of the eager path.

The forward saves q, k, v, out and the LSE (no O(N^2) tensor); the backward recomputes the
probabilities from them block by block (fagen.runtime.call.attention_backward). The LSE is not
differentiable, as in flash-attn. A gradient that autograd does not need is not returned.
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
import dataclasses
from typing import Optional

import torch

from ..runtime import call as runtime_call
from ..runtime import driver
from .adapter import (
    _check_device, _check_inputs, _check_mask_mod, _check_score_inputs, _current_stream, _flash_attn_fwd,
    _kernel_ready, _problem, _score_arrays, _tensor, flash_attn_fwd, get_bundle,
)


def _flash_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    softmax_scale: Optional[float],
    bundle: Optional[str],
    deterministic: bool,
    mask_mod: Optional[str] = None,
    mask_args: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dL/dsink (fp32 (nheads,); empty without sinks)."""
    _check_inputs(q, k, v)
    _check_device(q, k, v)
    _check_score_inputs(q, softcap, alibi_slopes, learnable_sink)
    _check_mask_mod(q, mask_mod, mask_args, causal, (window_left, window_right))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dsink = torch.zeros(0 if learnable_sink is None else q.shape[2], dtype=torch.float32, device=q.device)
    problem = _problem(q, k, v, causal, (window_left, window_right), softcap, alibi_slopes is not None,
                       learnable_sink is not None, mask_mod)
    if problem.seqlen_k == 0 or dq.numel() == 0:
        # No score depends on any input: every gradient is zero (the sink's too: with no key
        # its probability is 1 and O = 0 whatever its value).
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    device = q.device.index
    kernels = get_bundle(bundle)
    entry = runtime_call.select_backward(kernels, problem, device)
    with driver.primary_context(device):
        q, k, v, out, dout = (_kernel_ready(t) for t in (q, k, v, out, dout))
        lse = lse.contiguous()
        tensors = runtime_call.BackwardTensors(
            q=_tensor(q), k=_tensor(k), v=_tensor(v), out=_tensor(out), dout=_tensor(dout),
            dq=_tensor(dq), dk=_tensor(dk), dv=_tensor(dv), lse=lse.data_ptr())
        enqueue_backward(kernels, entry, problem, tensors, dsink, alibi_slopes, learnable_sink, mask_args,
                         softmax_scale, deterministic, device)
    return dq, dk, dv, dsink


def enqueue_backward(kernels, entry, problem: runtime_call.Problem, tensors: runtime_call.BackwardTensors,
                     dsink: torch.Tensor, alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                     mask_args: Optional[torch.Tensor], softmax_scale: Optional[float], deterministic: bool,
                     device: int, varlen: Optional[runtime_call.Varlen] = None) -> None:
    """The backward's kernels on torch's current stream (the device's primary context current):
    its workspace (and the deterministic mode's zeroed semaphores) from torch's allocator, the
    modifiers' arrays with dsink, for a dense or (with `varlen`) a varlen problem."""
    sizes = runtime_call.backward_workspace(entry, problem, None if varlen is None else varlen.total_q)
    workspace = torch.empty(sizes.floats, dtype=torch.float32, device=dsink.device)
    semaphores = torch.zeros(sizes.semaphores, dtype=torch.int32, device=dsink.device) if deterministic else None
    arrays, _copies = _score_arrays(alibi_slopes, learnable_sink, mask_args)  # alive until the launch is enqueued
    if learnable_sink is not None:
        arrays = dataclasses.replace(arrays, dsinks=dsink.data_ptr())
    runtime_call.attention_backward(
        kernels, problem, tensors, workspace=workspace.data_ptr(),
        semaphores=0 if semaphores is None else semaphores.data_ptr(),
        softmax_scale=softmax_scale, stream=_current_stream(device), device=device,
        entry=entry, score_tensors=arrays, varlen=varlen)


flash_attn_bwd = torch.library.custom_op("fagen::flash_attn_bwd", mutates_args=())(_flash_attn_bwd)


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, causal, window_left,
                         window_right, softcap, softmax_scale, bundle, deterministic, mask_mod=None,
                         mask_args=None):
    _check_inputs(q, k, v)
    dsink = q.new_empty(0 if learnable_sink is None else q.shape[2], dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


def _needed(ctx, grads: tuple, sink: Optional[torch.Tensor]) -> tuple:
    """dq, dk, dv, None for the slopes, dsink in the sink's dtype: those autograd needs."""
    dq, dk, dv, dsink = grads
    dsink = None if sink is None else dsink.to(sink.dtype)
    grads = (dq, dk, dv, None, dsink)
    return tuple(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:5]))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, alibi_slopes, learnable_sink, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, learnable_sink)
    # causal, window_left, window_right, softcap, softmax_scale, bundle, deterministic, mask_mod,
    # mask_args
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(lse)


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, learnable_sink = ctx.saved_tensors
    grads = flash_attn_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, *ctx.options)
    return (*_needed(ctx, grads, learnable_sink), *(None,) * len(ctx.options))


flash_attn_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class FlashAttention(torch.autograd.Function):
    """The eager path's autograd: the same kernels as the op, without the dispatcher (whose
    first call would import torch._dynamo, seconds)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, learnable_sink, *options):
        out, lse = _flash_attn_fwd(q, k, v, alibi_slopes, learnable_sink, *options)
        _setup_context(ctx, (q, k, v, alibi_slopes, learnable_sink, *options), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, learnable_sink = ctx.saved_tensors
        grads = _flash_attn_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, *ctx.options)
        return (*_needed(ctx, grads, learnable_sink), *(None,) * len(ctx.options))

