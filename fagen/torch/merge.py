"""merge_attention_states: one attention's result from two attentions over disjoint key sets,
from their outputs and LSEs (what vLLM's cascade attention, SGLang's merge_state and context
parallelism do with a shared prefix and each request's own keys).

With a_i = exp(lse_a - m), b_i = exp(lse_b - m), m = max(lse_a, lse_b) per row: out = (a out_a +
b out_b) / (a + b), lse = m + log(a + b), in fp32; a row whose two LSEs are -inf (it saw no key
in either) gets 0 and -inf. Tensor operations only, so it runs under torch.compile and inside a
CUDA graph; not a fused kernel (its time was not measured against one).
"""

from __future__ import annotations

import math

import torch

_NAME = "fagen.merge_attention_states"


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the attention over both key sets. out_a, out_b: (..., tokens, nheads, d) in
    fagen's (flash-attn's) layouts, dense (batch, seqlen, nheads, d) or packed (total, nheads,
    d); lse_a, lse_b: their natural-log LSEs as fagen returns them, (..., nheads, tokens) fp32.
    The output has out_a's dtype, the LSE is fp32."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"{_NAME}: the two results must have one shape: out {tuple(out_a.shape)} / "
                         f"{tuple(out_b.shape)}, lse {tuple(lse_a.shape)} / {tuple(lse_b.shape)}")
    if out_a.dim() < 3 or lse_a.shape != (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]):
        raise ValueError(f"{_NAME}: lse must be out's (..., nheads, tokens) = "
                         f"{(*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])}, got {tuple(lse_a.shape)}")
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
