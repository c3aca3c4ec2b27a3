"""The backward of flash_attn_func: the custom op ``fagen::flash_attn_bwd`` (with its fake
implementation), the autograd of the forward op, and the autograd.Function of the eager path.

The forward saves q, k, v, out and the LSE (no O(N^2) tensor); the backward recomputes the
probabilities from them block by block (fagen.runtime.call.attention_backward), its launch
prepared once per signature of the call (fagen.runtime.prepared). The eager path keys it by
what the backward adds to its forward's kept launch, which stands for the rest of the
signature. The LSE is not differentiable, as in flash-attn. A gradient that autograd does not
need is not returned.
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
import dataclasses
from typing import NamedTuple, Optional

import torch

from ..contract import ALIGNMENT_BYTES
from ..runtime import call as runtime_call
from ..runtime import driver
from ..runtime.prepared import BackwardPointers, PreparedBackward, prepare_backward
from .adapter import (
    _PREPARED_LAUNCHES_KEPT, _bundle_request, _check_device, _check_inputs, _check_mask_mod, _check_score_inputs,
    _current_stream, _forward, _kernel_strides, _problem, _score_arrays, _tensor, define_op, get_bundle,
)


class _KeptBackward(NamedTuple):
    """A prepared backward, and which of q, k, v, out, dout its calls copy to a layout the
    kernels read (_kernel_ready's choice, which the signature decides)."""

    launch: PreparedBackward
    copies: tuple[bool, ...]


# The op's prepared backwards of earlier calls, by everything their launches depend on but the
# addresses, which each launch writes: a training step's backward of a signature seen before
# skips the checks, the kernel choice and the parameter building (bench/host_model.py: 232 -> 65
# us of this function's host time per call on a 2-core CPU). The eager autograd keeps its own in
# its forward's kept launch, under a key of what the backward adds (FlashAttention.backward),
# which spares it this signature (about 10 us).
_prepared_backwards: dict[tuple, _KeptBackward] = {}


def _layout(t: Optional[torch.Tensor]) -> tuple:
    """What the checks, the copies and the parameters read of a tensor: all but its address,
    of which only the alignment."""
    return () if t is None else (t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % ALIGNMENT_BYTES)


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
    signature = (_bundle_request(bundle), causal, window_left, window_right, softcap, softmax_scale, deterministic,
                 mask_mod, *map(_layout, (q, k, v, out, dout, alibi_slopes, learnable_sink, mask_args)))
    dq, dk, dv, dsink = _backward(_prepared_backwards, signature, dout, q, k, v, out, lse, alibi_slopes,
                                  learnable_sink, causal, window_left, window_right, softcap, softmax_scale, bundle,
                                  deterministic, mask_mod, mask_args)
    if dsink is None:  # the op returns a tensor whatever the call
        dsink = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dsink


def _backward(kept_backwards: dict, key: tuple, dout, q, k, v, out, lse, alibi_slopes, learnable_sink, causal,
              window_left, window_right, softcap, softmax_scale, bundle, deterministic, mask_mod, mask_args):
    """dq, dk, dv and dL/dsink (fp32 (nheads,), None without sinks) of the launch kept in
    `kept_backwards` under `key`, which must stand for everything the checks, the kernel choice,
    the copies and the parameters read (all but the addresses); checked, prepared and kept
    there on the first call of `key`."""
    inputs = (q, k, v, out, dout)
    kept = kept_backwards.get(key)
    if kept is None:  # checked once per key: a later call of it passes the same checks
        _check_inputs(q, k, v)
        _check_device(q, k, v)
        _check_score_inputs(q, softcap, alibi_slopes, learnable_sink)
        _check_mask_mod(q, mask_mod, mask_args, causal, (window_left, window_right))
        if k.shape[1] == 0 or q.numel() == 0:
            # No score depends on any input: every gradient is zero (the sink's too: with no key
            # its probability is 1 and O = 0 whatever its value).
            dsink = None if learnable_sink is None else torch.zeros(q.shape[2], dtype=torch.float32, device=q.device)
            return (*(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), dsink)
        kernels = get_bundle(bundle)
        problem = _problem(q, k, v, causal, (window_left, window_right), softcap, alibi_slopes is not None,
                           learnable_sink is not None, mask_mod)
        entry = runtime_call.select_backward(kernels, problem, q.device.index)
        # TMA kernels map q, k, v and dout, which must have no broadcast (stride 0) dimension.
        tma = entry.launch.tma_q_rows > 0
        copies = tuple(_kernel_strides(t, tma and name != "out") is None
                       for name, t in zip(("q", "k", "v", "out", "dout"), inputs))
    else:
        copies = kept.copies
    device = q.device.index
    with driver.primary_context(device):
        if True in copies:  # layouts the kernels cannot read, copied on every call
            q, k, v, out, dout = (t.clone(memory_format=torch.contiguous_format) if copy else t
                                  for t, copy in zip(inputs, copies))
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        dsink = None if learnable_sink is None else q.new_zeros(q.shape[2], dtype=torch.float32)
        lse = lse.contiguous()
        arrays, _copies = _backward_arrays(alibi_slopes, learnable_sink, mask_args, dsink)  # alive until enqueued
        if kept is None:
            tensors = runtime_call.BackwardTensors(
                q=_tensor(q), k=_tensor(k), v=_tensor(v), out=_tensor(out), dout=_tensor(dout),
                dq=_tensor(dq), dk=_tensor(dk), dv=_tensor(dv), lse=lse.data_ptr())
            kept = _KeptBackward(prepare_backward(kernels, problem, tensors, deterministic=deterministic,
                                                  softmax_scale=softmax_scale, device=device, entry=entry,
                                                  score_tensors=arrays), copies)
            if len(kept_backwards) >= _PREPARED_LAUNCHES_KEPT:
                kept_backwards.clear()
            kept_backwards[key] = kept
        pointers = BackwardPointers(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
                                    dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), lse.data_ptr())
        enqueue_backward(kept.launch, pointers, arrays, q.device)
    return dq, dk, dv, dsink


def _backward_arrays(alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                     mask_args: Optional[torch.Tensor], dsink: Optional[torch.Tensor]):
    """_score_arrays with dsink (read with sinks only), which the backward writes: the
    ScoreTensors, and the arrays to keep alive until the launch is enqueued."""
    arrays, copies = _score_arrays(alibi_slopes, learnable_sink, mask_args)
    if learnable_sink is not None:
        arrays = dataclasses.replace(arrays, dsinks=dsink.data_ptr())
    return arrays, copies


def enqueue_backward(prepared: PreparedBackward, pointers: BackwardPointers, arrays: runtime_call.ScoreTensors,
                     device: torch.device, varlen: Optional[runtime_call.Varlen] = None) -> None:
    """A prepared backward on torch's current stream (the device's primary context current),
    its workspace (and the deterministic mode's zeroed semaphores) from torch's allocator."""
    sizes = prepared.workspace
    workspace = torch.empty(sizes.floats, dtype=torch.float32, device=device)
    semaphores = torch.zeros(sizes.semaphores, dtype=torch.int32, device=device) if prepared.deterministic else None
    prepared.enqueue(pointers, workspace.data_ptr(), 0 if semaphores is None else semaphores.data_ptr(),
                     _current_stream(device.index), arrays, varlen)


def _flash_attn_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, causal, window_left,
                         window_right, softcap, softmax_scale, bundle, deterministic, mask_mod=None,
                         mask_args=None):
    _check_inputs(q, k, v)
    dsink = q.new_empty(0 if learnable_sink is None else q.shape[2], dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


# No autograd of its own (no double backward): the dispatcher's fallback, in C++, spares each
# call a Python autograd kernel.
flash_attn_bwd = define_op("flash_attn_bwd", _flash_attn_bwd, _flash_attn_bwd_fake)


def _needed(ctx, grads: tuple, sink: Optional[torch.Tensor]) -> tuple:
    """dq, dk, dv, None for the slopes, dsink in the sink's dtype: those autograd needs."""
    dq, dk, dv, dsink = grads
    needed = ctx.needs_input_grad
    return (dq if needed[0] else None, dk if needed[1] else None, dv if needed[2] else None, None,
            dsink.to(sink.dtype) if sink is not None and needed[4] else None)


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


torch.library.register_autograd("fagen::flash_attn_fwd", _op_backward, setup_context=_setup_context)


class FlashAttention(torch.autograd.Function):
    """The eager path's autograd: the same kernels as the op, without the dispatcher (whose
    first call would import torch._dynamo, seconds). The op's arguments after the sink come as
    one tuple, `options`: autograd's apply costs about half a microsecond per argument."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, learnable_sink, options):
        causal, window_left, window_right, softcap, softmax_scale, bundle, _deterministic, mask_mod, mask_args = options
        out, lse, ctx.forward_launch = _forward(q, k, v, causal, (window_left, window_right), softmax_scale, bundle,
                                                softcap, alibi_slopes, learnable_sink, mask_mod, mask_args)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, learnable_sink)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, learnable_sink = ctx.saved_tensors
        forward = ctx.forward_launch
        if forward is None:  # a forward that kept no launch (copied inputs, nothing to attend to)
            grads = _flash_attn_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, *ctx.options)
        else:
            # The forward's kept launch stands for its signature: the bundle request, the options,
            # q, k, v and the arrays with their addresses, so out's shape, dtype and strides too.
            # What the backward reads beyond it: the mode, out's alignment and dout.
            causal, window_left, window_right, softcap, softmax_scale, bundle, deterministic, mask_mod, mask_args = (
                ctx.options)
            key = (deterministic, out.data_ptr() % ALIGNMENT_BYTES, _layout(dout))
            grads = _backward(forward.backwards, key, dout, q, k, v, out, lse, alibi_slopes, learnable_sink, causal,
                              window_left, window_right, softcap, softmax_scale, bundle, deterministic, mask_mod,
                              mask_args)
        return (*_needed(ctx, grads, learnable_sink), None)
