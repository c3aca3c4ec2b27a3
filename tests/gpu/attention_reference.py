"""The fp32 / low-precision reference the GPU tests hold fagen's kernels to (DESIGN.md's 2x
rule): plain torch math, no fused kernels."""

from __future__ import annotations

import math

import torch


def attention_math(q, k, v, causal, scale, dtype):
    """Explicit softmax attention computed in `dtype`; returns out (b, sq, h, d) and LSE (b, h, sq)."""
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    qh = q.to(dtype).transpose(1, 2)
    kh = k.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        row = torch.arange(seqlen_q, device=q.device).view(-1, 1)
        col = torch.arange(seqlen_k, device=q.device).view(1, -1)
        scores = scores.masked_fill(col > row + (seqlen_k - seqlen_q), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key: softmax gives NaN, the defined result is 0 (and LSE -inf).
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ vh).transpose(1, 2), lse
