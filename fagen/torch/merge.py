"""merge_attention_states: one attention's result from two attentions over disjoint key sets,
from their outputs and LSEs (what vLLM's cascade attention, SGLang's merge_state and context
parallelism do with a shared prefix and each request's own keys).

With a_i = exp(lse_a - m), b_i = exp(lse_b - m), m = max(lse_a, lse_b) per row: out = (a out_a +
b out_b) / (a + b), lse = m + log(a + b), in fp32; a row whose two LSEs are -inf (it saw no key
in either) gets 0 and -inf. fp16/bf16 results on a GPU take one fused launch, the merge entry
point of the bundle's paged-layout kernels (fagen.runtime.merge; the custom op
fagen::merge_attention_states under torch.compile); other dtypes, CPU tensors, head dims that are
not a multiple of 8 and bundles without a paged-layout kernel of the dtype for the GPU take the
same formula as tensor operations. Both run inside a CUDA graph (no host synchronisation).
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
import math
from typing import Optional

import torch

from ..runtime import KernelNotFound, driver
from ..runtime import merge as runtime_merge
from ..runtime.call import Tensor
from .adapter import _DTYPE_NAMES, _current_stream, bundle_argument, define_op, eager_call, get_bundle

_NAME = "fagen.merge_attention_states"


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor, *, bundle=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the attention over both key sets. out_a, out_b: (..., tokens, nheads, d) in
    fagen's (flash-attn's) layouts, dense (batch, seqlen, nheads, d) or packed (total, nheads,
    d); lse_a, lse_b: their natural-log LSEs as fagen returns them, (..., nheads, tokens) fp32.
    The output has out_a's dtype, the LSE is fp32. `bundle`: where the fused kernel comes from
    (the torch adapter's default bundle)."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"{_NAME}: the two results must have one shape: out {tuple(out_a.shape)} / "
                         f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} / {tuple(lse_b.shape)}")
    if out_a.dim() < 3 or lse_a.shape != (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]):
        raise ValueError(f"{_NAME}: lse must be out's (..., nheads, tokens) = "
                         f"{(*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])}, got {tuple(lse_a.shape)}")
    if out_a.dtype != out_b.dtype or out_a.device != out_b.device:
        raise ValueError(f"{_NAME}: out_a and out_b must share a dtype and device")
    if out_a.device.type == "cuda" and out_a.dtype in _DTYPE_NAMES and \
            out_a.shape[-1] % runtime_merge.MERGE_HEAD_DIM_MULTIPLE == 0:
        bundle = bundle_argument(bundle)
        lse_a, lse_b = lse_a.float(), lse_b.float()
        if eager_call(out_a, lse_a, out_b, lse_b):
            return _merge(out_a, lse_a, out_b, lse_b, bundle)
        return merge_states(out_a, lse_a, out_b, lse_b, bundle)
    return _merge_tensors(out_a, lse_a, out_b, lse_b)


def _as_rows(out: torch.Tensor) -> torch.Tensor:
    """out as (batch, tokens, nheads, d) with a contiguous last dimension and 16-byte rows."""
    rows = out.reshape(-1, *out.shape[-3:])
    if rows.stride(-1) != 1 or any(s % 8 for s in rows.stride()[:-1]) or rows.data_ptr() % 16:
        rows = rows.contiguous()
    return rows


def _states(out: torch.Tensor, lse: torch.Tensor) -> runtime_merge.States:
    return runtime_merge.States(Tensor(out.data_ptr(), *out.stride()[:3]), lse.data_ptr(), lse.stride(0),
                                lse.stride(1))


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
           bundle: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused merge (the custom op fagen::merge_attention_states), or the tensor operations
    where the bundle has no paged-layout kernel of the dtype for the GPU."""
    shape, lse_shape = out_a.shape, lse_a.shape
    device = out_a.device.index
    kernels = get_bundle(bundle)
    try:
        entry = runtime_merge.merge_kernel(kernels, _DTYPE_NAMES[out_a.dtype], driver.compute_capability(device))
    except KernelNotFound:
        out, lse = _merge_tensors(out_a, lse_a, out_b, lse_b)
        return out.contiguous(), lse.contiguous()
    a, b = _as_rows(out_a), _as_rows(out_b)
    lse_a, lse_b = (t.reshape(-1, *lse_shape[-2:]).contiguous() for t in (lse_a, lse_b))
    out = torch.empty_like(a, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_a)
    batch, seqlen, heads, head_dim = a.shape
    if out.numel():
        with driver.primary_context(device):
            prepared = runtime_merge.prepare_merge(
                kernels, _DTYPE_NAMES[out.dtype], batch, seqlen, heads, head_dim, _states(a, lse_a),
                _states(b, lse_b), _states(out, lse), device, entry)
            prepared.enqueue(_current_stream(device))
    return out.view(shape), lse.view(lse_shape)


def _merge_fake(out_a, lse_a, out_b, lse_b, bundle):
    return (torch.empty_like(out_a, memory_format=torch.contiguous_format),
            torch.empty_like(lse_a, memory_format=torch.contiguous_format))


merge_states = define_op("merge_attention_states", _merge, _merge_fake)


def _merge_tensors(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge as tensor operations (any dtype and device)."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    # Rows that saw no key in either half: a finite pivot keeps exp() from giving NaN.
    pivot = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight_a, weight_b = torch.exp(lse_a - pivot), torch.exp(lse_b - pivot)
    total = weight_a + weight_b
    lse = torch.where(total > 0, pivot + torch.log(total), torch.full_like(total, -math.inf))
    scale = 1.0 / torch.where(total > 0, total, torch.ones_like(total))
    as_rows = lambda w: (w * scale).transpose(-1, -2).unsqueeze(-1)  # (..., tokens, nheads, 1)
    out = out_a.float() * as_rows(weight_a) + out_b.float() * as_rows(weight_b)
    return out.to(out_a.dtype), lse
