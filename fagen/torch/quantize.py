"""Host-side helpers for the FP8 forward: quantising tensors to e4m3 with flash-attn's descales,
and incoherent processing (FlashAttention-3, section 3.3).

Incoherent processing multiplies q and k by the same random orthogonal matrix R (a Hadamard
matrix with random signs, scaled by 1/sqrt(d)) before quantising them: (q R)(k R)^T = q k^T, so
the scores are unchanged, but an outlier in one feature is spread over all d features, so the
per-tensor descale (set by the largest magnitude) no longer crushes every other value towards
e4m3's subnormals. v is not rotated (P V would need R^T applied to the output). What it buys on
outlier-heavy inputs is measured by `python -m bench.fp8 --accuracy` (docs/performance.md).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_e4m3(x: torch.Tensor, heads_kv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seqlen, heads, d) as float8_e4m3fn and its descale (x ~ x8 * descale): one fp32
    value of shape (1,) per tensor, or with `heads_kv` one per (batch, kv head), shape (batch,
    heads_kv), as flash_attn_func's q_descale / k_descale / v_descale take them (q's query heads
    share their KV head's). Each descale is the amax it covers / 448, so that its largest value
    lands on e4m3's largest."""
    if x.dim() != 4:
        raise ValueError(f"quantize_e4m3: x must be (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    x32 = x.float()
    if heads_kv is None:
        descale = (x32.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX).reshape(1)
        return (x32 / descale).to(E4M3), descale
    batch, seqlen, heads, dim = x.shape
    if heads % heads_kv:
        raise ValueError(f"quantize_e4m3: heads={heads} is not a multiple of heads_kv={heads_kv}")
    grouped = x32.view(batch, seqlen, heads_kv, heads // heads_kv, dim)
    descale = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
    per_head = descale.repeat_interleave(heads // heads_kv, dim=1)[:, None, :, None]
    return (x32 / per_head).to(E4M3), descale


def random_orthogonal(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """An orthogonal (head_dim, head_dim) fp32 matrix: a Sylvester Hadamard matrix with a random
    sign per row, over sqrt(head_dim); head_dim a power of two (64, 128, 256)."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"random_orthogonal: head_dim={head_dim} must be a power of two")
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim, 1), generator=generator).float() * 2 - 1
    return (signs * hadamard / head_dim ** 0.5).to(device)


def incoherent_qk(q: torch.Tensor, k: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q R and k R for one random orthogonal R (random_orthogonal of their head dim): the same
    scores, outliers spread over the head dim; in q's and k's dtype, ready for quantize_e4m3."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incoherent_qk: q and k need one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    rotation = random_orthogonal(q.shape[-1], seed, q.device)
    return (q.float() @ rotation).to(q.dtype), (k.float() @ rotation).to(k.dtype)
