"""The references and the numerics rule the GPU tests hold fagen's kernels to (DESIGN.md).

The reference is attention computed in fp64. An output passes when its max error is at most 2x
(a gradient: 3x) the largest error of three low-precision computations by plain torch and of
the reference itself rounded to the low dtype (no result in that dtype can be closer), plus a
tiny atol:
- `attention_math` in the low dtype: the explicit softmax, and torch's autograd through it;
- `flash_recurrence`: FlashAttention's own arithmetic in torch: scores summed in fp32, fp32 row
  statistics, the exponents as the kernels take them (algo/lse.cuh: one FMA in the forward,
  fl(s * scale_log2) - LSE2 in the backward), P rounded to the low dtype where it is a matrix
  operand and the row sum corrected for the largest P's rounding (algo/online_softmax.cuh), the
  natural-log LSE, and a backward that recomputes the scores (in another summation order) and P
  from that LSE, with D = rowsum(dO * O) from the output rounded to the low dtype.
- `torch_flash`: torch's own FlashAttention-2 kernel (aten's `_flash_attention_forward` and
  `_backward`, what SDPA's flash backend runs), where torch has it for the inputs;
and for a gradient whose forward output is known (`gradient_errors(..., out)`), the recurrence's
backward with D from that output: its rounding is the forward's, checked by the forward's rule,
and may fall one way in fagen's forward and the other in the computations above.
The second is needed where one key dominates a row (few keys, large scores): there torch's
softmax gives P = 1 exactly and its backward dS = 1 * (g - g) = 0 exactly, an exactness that no
FlashAttention kernel has: its exponents carry fp32 roundings at the scores' magnitude (an ulp
of 4096 is 2^-11), the backward's recomputed scores differ from the forward's in their last bits,
and D comes from the rounded output. With large scores those are a floor of the algorithm, which
the second computation measures on the same inputs; with unit-size inputs the two errors are
alike. The third adds what no fp32 emulation in torch reproduces: the tensor cores' summation
(their fp32 sums are not IEEE-rounded additions) and a backward whose dP (tensor cores) and D (fp32 on
the CUDA cores) are summed differently, so that dS is not exactly 0 where one key takes the whole
row. With inputs x16 and outliers x100 that floor is 10-100x the second's error in dQ and the
LSE, and fagen's kernels, torch's and cuDNN's all meet it to two or three digits (replays of the
randomised test's cases, 2026-12-01). The rounded reference is the floor where one output
element is much larger than the rest: its correct rounding is an ulp away from a neighbour, and
the three computations may happen to round it right where fagen does not (dK of 4 to 8 in fp16,
an ulp of 0.004, against errors of 0.0006 elsewhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fagen import contract

REFERENCE = torch.float64
OUT_ATOL = 1e-5
LSE_ATOL = 1e-3
GRAD_ATOL = 1e-4


def visible(seqlen_q, seqlen_k, causal, device, window=(-1, -1)):
    """(seqlen_q, seqlen_k) bool: which keys a query row sees, by flash-attn's rule for causal and
    window_size (bottom-right aligned, -1 or a size >= seqlen_k unbounded, causal: right = 0),
    written out here rather than taken from fagen's contract.call_mask."""
    row = torch.arange(seqlen_q, device=device).view(-1, 1)
    col = torch.arange(seqlen_k, device=device).view(1, -1)
    left, right = (-1 if size >= seqlen_k else size for size in window)
    if causal:
        right = 0
    diagonal = row + (seqlen_k - seqlen_q)
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= col <= diagonal + right
    if left >= 0:
        seen &= col >= diagonal - left
    return seen


@dataclass(frozen=True)
class Mods:
    """The score modifiers of a call, flash-attn's semantics: softcap > 0 caps the scaled scores
    at softcap * tanh(score / softcap); alibi (heads,) or (batch, heads) adds -slope * |i +
    seqlen_k - seqlen_q - j| after it; sink (heads,) is a logit in every row's softmax that adds
    nothing to the output."""

    softcap: float = 0.0
    alibi: torch.Tensor | None = None
    sink: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return self.softcap > 0 or self.alibi is not None or self.sink is not None

    def distance(self, seqlen_q, seqlen_k, device):
        row = torch.arange(seqlen_q, device=device).view(-1, 1)
        col = torch.arange(seqlen_k, device=device).view(1, -1)
        return (row + seqlen_k - seqlen_q - col).abs()

    def slopes(self, batch, dtype):
        """(batch, heads, 1, 1) slopes."""
        slopes = self.alibi.to(dtype)
        slopes = slopes.expand(batch, -1) if slopes.dim() == 1 else slopes
        return slopes[:, :, None, None]

    def modify(self, scaled, dtype):
        """Scaled scores (b, h, sq, sk) in `dtype` -> the modified logits."""
        if self.softcap > 0:
            scaled = self.softcap * torch.tanh(scaled / self.softcap)
        if self.alibi is not None:
            distance = self.distance(scaled.shape[2], scaled.shape[3], scaled.device).to(dtype)
            scaled = scaled - self.slopes(scaled.shape[0], dtype) * distance
        return scaled


NO_MODS = Mods()


def geometric_alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's slopes for `heads` heads: 2^(-8 (i + 1) / heads), fp32."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)


def heads_first(q, k, v, dtype):
    """q, k, v as (batch, heads_q, seqlen, d) in `dtype`, K/V repeated over their query heads."""
    group = q.shape[2] // k.shape[2]
    return (q.to(dtype).transpose(1, 2), k.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2),
            v.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2))


def fold_heads(grad, heads_kv):
    """(batch, heads_q, seqlen, d) -> (batch, seqlen, heads_kv, d), summed over each group."""
    batch, heads_q, seqlen, dim = grad.shape
    return grad.view(batch, heads_kv, heads_q // heads_kv, seqlen, dim).sum(2).transpose(1, 2)


def attention_math(q, k, v, causal, scale, dtype, window=(-1, -1), mods=NO_MODS, sink=None):
    """Explicit softmax attention computed in `dtype`; returns out (b, sq, h, d) and LSE (b, h, sq).
    `sink`: the sink logits to use (a tensor autograd tracks), default mods.sink in `dtype`."""
    qh, kh, vh = heads_first(q, k, v, dtype)
    scores = mods.modify((qh @ kh.transpose(-1, -2)) * scale, dtype)
    scores = scores.masked_fill(~visible(q.shape[1], k.shape[1], causal, q.device, window), -math.inf)
    if mods.sink is not None:
        sink = mods.sink.to(dtype) if sink is None else sink
        column = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, column], dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return (probs @ vh).transpose(1, 2), lse
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key: softmax gives NaN, the defined result is 0 (and LSE -inf).
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ vh).transpose(1, 2), lse


def math_grads(q, k, v, dout, causal, scale, dtype, window=(-1, -1), mods=NO_MODS):
    """out, lse and dq, dk, dv (and dsink with a sink) of `attention_math` in `dtype` (torch's
    autograd), as float."""
    inputs = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    sink = None if mods.sink is None else mods.sink.detach().to(dtype).requires_grad_(True)
    out, lse = attention_math(*inputs, causal, scale, dtype, window, mods, sink)
    out.backward(dout.to(dtype))
    grads = [t.grad for t in inputs] + ([] if sink is None else [sink.grad])
    return out.detach(), lse.detach(), grads


def fused_exponent(scores, subtrahend, scale_log2):
    """fp32 of scores * scale_log2 - subtrahend with one rounding, as the forward's FFMA gives it
    (the product of two fp32 values is exact in fp64)."""
    return (scores.double() * scale_log2 - subtrahend.double()).float()


def backward_exponent(scores, lse2, scale_log2):
    """fl(scores * scale_log2) - lse2 in fp32, two roundings, as the backward takes it."""
    return scores * scale_log2 - lse2


def fp32_scores(qh, kh, split=1):
    """Q K^T of 16-bit operands, summed in IEEE fp32 (torch 2.11 has no 16-bit matmul with an fp32
    result, which would sum on the tensor cores as the kernels do). `split` > 1 sums the head dim
    in that many parts: the other summation order of a backward that recomputes the scores."""
    total = None
    for a, b in zip(qh.chunk(split, dim=-1), kh.chunk(split, dim=-1)):
        part = a.float() @ b.float().transpose(-1, -2)
        total = part if total is None else total + part
    return total


def kernel_units(scores, q, mods, scale):
    """fp32 raw scores -> the values the kernels take exponents of (templates/include/fagen/algo/
    score.cuh), the scale_log2 they use, and the softcap's 1 - u^2 (None without)."""
    kernel_scale = contract.kernel_score_scale(scale, q.shape[-1], mods.softcap)
    scale_log2 = torch.tensor(kernel_scale.scale_log2, dtype=torch.float32).item()
    dsoftcap = None
    if mods.softcap > 0:
        scores = torch.tanh(scores * torch.tensor(kernel_scale.softcap_scale, dtype=torch.float32).item())
        dsoftcap = 1 - scores * scores
    if mods.alibi is not None:
        units = mods.slopes(scores.shape[0], torch.float32) * (math.log2(math.e) / scale_log2)
        scores = scores - units * mods.distance(scores.shape[2], scores.shape[3], scores.device).float()
    return scores, scale_log2, dsoftcap


def flash_recurrence(q, k, v, causal, scale, dtype, dout=None, given_out=None, window=(-1, -1), mods=NO_MODS):
    """FlashAttention's arithmetic by plain torch in fp32 with `dtype` operands (the module's
    docstring), with the score modifiers as the kernels apply them. Returns out (b, sq, h, d) and
    LSE (b, h, sq), then dq, dk, dv (and dsink with a sink) when dout is given, each in `dtype`
    (the LSE and dsink in fp32). `given_out` (b, sq, h, d): the backward's D from that output
    instead of its own."""
    low = heads_first(q, k, v, dtype)
    qh, kh, vh = (t.float() for t in low)
    hidden = ~visible(q.shape[1], k.shape[1], causal, q.device, window)
    scores, scale_log2, _ = kernel_units(fp32_scores(low[0], low[1]), q, mods, scale)
    scores = scores.masked_fill(hidden, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    reference = torch.where(row_max > -math.inf, row_max * scale_log2, 0.0)  # fp32, as the kernels round it
    probs = torch.exp2(fused_exponent(scores, reference, scale_log2))
    row_sum = probs.sum(-1, keepdim=True)
    seen = row_sum > 0
    top = probs.amax(-1, keepdim=True)
    divisor = row_sum + (top.to(dtype).float() - top)  # the largest P as P V sees it
    numerator = probs.to(dtype).float() @ vh
    if mods.sink is not None:  # algo/online_softmax.cuh, finalize: against the larger reference
        sink2 = (mods.sink.float() * math.log2(math.e)).view(1, -1, 1, 1)
        peak = torch.where(seen, torch.maximum(reference, sink2), sink2)
        keys = torch.where(seen, torch.exp2(reference - peak), 0.0)
        sink_p = torch.exp2(sink2 - peak)
        out = (numerator * keys / (divisor * keys + sink_p)).to(dtype)
        lse = (peak + torch.log2(row_sum * keys + sink_p)) * math.log(2.0)
        seen = torch.ones_like(seen)
    else:
        out = torch.where(seen, numerator / divisor.clamp_min(1e-38), 0.0).to(dtype)
        # The LSE is kept in natural log (flash-attn's softmax_lse) and turned back into base 2 for
        # the backward, fp32 each way; +inf for a row that saw no key, so that its probabilities
        # are 0.
        lse = torch.where(seen, (reference + torch.log2(row_sum.clamp_min(1e-38))) * math.log(2.0), -math.inf)
    if dout is None:
        return out.transpose(1, 2), lse.squeeze(-1)
    lse2 = torch.where(seen, lse / math.log(2.0), math.inf)
    scores, _, dsoftcap = kernel_units(fp32_scores(low[0], low[1], split=2), q, mods, scale)  # recomputed
    probs = torch.exp2(backward_exponent(scores.masked_fill(hidden, -math.inf), lse2, scale_log2))
    do = dout.to(dtype).transpose(1, 2).float()
    d_from = out if given_out is None else given_out.to(dtype).transpose(1, 2)
    dsum = (do * d_from.float()).sum(-1, keepdim=True)
    dscores = probs * (do @ vh.transpose(-1, -2) - dsum)
    if dsoftcap is not None:
        dscores = dscores * dsoftcap
    heads_kv = k.shape[2]
    dv = fold_heads(probs.to(dtype).float().transpose(-1, -2) @ do, heads_kv)
    dk = fold_heads(scale * (dscores.to(dtype).float().transpose(-1, -2) @ qh), heads_kv)
    dq = (scale * (dscores.to(dtype).float() @ kh)).transpose(1, 2)
    grads = [g.to(dtype) for g in (dq, dk, dv)]
    if mods.sink is not None:
        grads.append(-(torch.exp2(sink2 - lse2) * dsum).sum(dim=(0, 2, 3)))
    return out.transpose(1, 2), lse.squeeze(-1), grads


def bar(factor, low_errors, atol):
    """factor x the largest of the low-precision errors, + atol. A low-precision computation that
    overflowed (torch's fp16 scores past 65504) or did not run (NaN) measures nothing and is left
    out."""
    finite = [e for e in low_errors if math.isfinite(e)]
    return factor * max(finite, default=0.0) + atol


def max_error(got, ref, where=None):
    diff = (got.to(REFERENCE) - ref.to(REFERENCE)).abs()
    if where is not None:
        diff = diff[where]
    return diff.max().item() if diff.numel() else 0.0


def torch_flash(q, k, v, causal, scale, dout=None, window=(-1, -1), mods=NO_MODS):
    """torch's FlashAttention-2 kernel on the same inputs, in flash-attn's layout and semantics
    (bottom-right causal, GQA): out (b, sq, h, d) and LSE (b, h, sq), then dq, dk, dv when dout is
    given; None where torch has no such kernel for these inputs (its error names why)."""
    if mods.any:
        return None  # torch's kernel has no score modifiers
    # Fresh storage: torch's kernel faults (a sticky CUDA error) on a view whose data pointer is
    # not 16-byte aligned, which .contiguous() leaves as it is.
    q, k, v = (torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) for t in (q, k, v))
    sides = {} if tuple(window) == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    try:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale, **sides)
        if dout is None:
            return out, lse
        grads = torch.ops.aten._flash_attention_backward(
            torch.empty_like(dout, memory_format=torch.contiguous_format).copy_(dout), q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal,
            seed, offset, scale=scale, **sides)
    except (RuntimeError, TypeError) as error:  # TypeError: a torch without window arguments
        if isinstance(error, getattr(torch, "AcceleratorError", ())):
            raise  # a fault, not a refusal: the context is lost, say so here
        return None
    return out, lse, list(grads)


def forward_errors(out, lse, q, k, v, causal, scale=None, window=(-1, -1), mods=NO_MODS):
    """{name: (fagen's max error, torch math's, the flash recurrence's, torch's flash kernel's
    (NaN where it has none), the rounded reference's)} for out and lse, or {name: message} for
    what is malformed or not finite; lse may be None."""
    scale = scale if scale is not None else contract.default_softmax_scale(q.shape[-1])
    ref_out, ref_lse = attention_math(q, k, v, causal, scale, REFERENCE, window, mods)
    low_out, low_lse = attention_math(q, k, v, causal, scale, q.dtype, window, mods)
    flash_out, flash_lse = flash_recurrence(q, k, v, causal, scale, q.dtype, window=window, mods=mods)
    kernel = torch_flash(q, k, v, causal, scale, window=window, mods=mods)
    expected = (*q.shape[:3], v.shape[3])  # the output has v's head dim
    if out.shape != expected or out.dtype != q.dtype:
        return {"out": f"shape {tuple(out.shape)} {out.dtype}, expected {expected} {q.dtype}"}
    if not torch.isfinite(out).all():
        return {"out": "not finite (unwritten or bad math)"}
    errors = {"out": (max_error(out, ref_out), max_error(low_out, ref_out), max_error(flash_out, ref_out),
                      max_error(kernel[0], ref_out) if kernel else math.nan,
                      max_error(ref_out.to(q.dtype), ref_out))}
    if lse is None:
        return errors
    finite = torch.isfinite(ref_lse)
    if lse.shape != (q.shape[0], q.shape[2], q.shape[1]) or lse.dtype != torch.float32:
        errors["lse"] = f"shape {tuple(lse.shape)} {lse.dtype}"
    elif lse.isnan().any() or not torch.equal(torch.isfinite(lse), finite) or not (lse[~finite] == -math.inf).all():
        errors["lse"] = "NaN, or its finite / -inf pattern differs from the reference"
    elif finite.any():
        errors["lse"] = (max_error(lse, ref_lse, finite), max_error(low_lse, ref_lse, finite),
                         max_error(flash_lse, ref_lse, finite),
                         max_error(kernel[1], ref_lse, finite) if kernel else math.nan,
                         max_error(ref_lse.float(), ref_lse, finite))
    return errors


def gradient_errors(grads, q, k, v, dout, causal, scale=None, out=None, window=(-1, -1), mods=NO_MODS):
    """forward_errors' form for dq, dk, dv (and dsink, the fourth gradient, with a sink), with one
    more computation where `out`, the forward output the backward under test was given, is known:
    the recurrence's backward with D from it; a None gradient is not checked."""
    scale = scale if scale is not None else contract.default_softmax_scale(q.shape[-1])
    names = ("dq", "dk", "dv") + (("dsink",) if mods.sink is not None else ())
    _, _, ref = math_grads(q, k, v, dout, causal, scale, REFERENCE, window, mods)
    _, _, low = math_grads(q, k, v, dout, causal, scale, q.dtype, window, mods)
    _, _, flash = flash_recurrence(q, k, v, causal, scale, q.dtype, dout, window=window, mods=mods)
    kernel = torch_flash(q, k, v, causal, scale, dout.to(q.dtype), window, mods)
    kernel_grads = kernel[2] if kernel else [None] * len(names)
    given = (flash_recurrence(q, k, v, causal, scale, q.dtype, dout, out, window, mods)[2] if out is not None
             else [None] * len(names))
    targets = (q, k, v) + ((mods.sink,) if mods.sink is not None else ())
    errors = {}
    for name, g, r, lo, fl, kg, gv, t in zip(names, grads, ref, low, flash, kernel_grads, given, targets):
        if g is None:
            continue
        if g.shape != t.shape or g.dtype != t.dtype:
            errors[name] = f"shape {tuple(g.shape)} {g.dtype}, expected {tuple(t.shape)} {t.dtype}"
        elif not torch.isfinite(g).all():
            errors[name] = f"{(~torch.isfinite(g)).sum().item()} entries not finite (the reference's are finite)"
        else:
            errors[name] = (max_error(g, r), max_error(lo, r), max_error(fl, r),
                            max_error(kg, r) if kg is not None else math.nan, max_error(r.to(t.dtype), r),
                            max_error(gv, r) if gv is not None else math.nan)
    return errors


RULES = {"out": (2, OUT_ATOL), "lse": (2, LSE_ATOL), "dq": (3, GRAD_ATOL), "dk": (3, GRAD_ATOL), "dv": (3, GRAD_ATOL),
         "dsink": (3, GRAD_ATOL)}


def failures_of(errors):
    """The rule applied to forward_errors / gradient_errors: one message per failing output."""
    failures = []
    for name, found in errors.items():
        if isinstance(found, str):
            failures.append(f"{name}: {found}")
            continue
        factor, atol = RULES[name]
        limit = bar(factor, found[1:], atol)
        if found[0] > limit:
            failures.append(f"{name}: max error {found[0]:.3e} > bar {limit:.3e} (torch math {found[1]:.3e}, "
                            f"flash recurrence {found[2]:.3e}, torch's flash kernel {found[3]:.3e}, "
                            f"the reference rounded {found[4]:.3e}"
                            + (f", the recurrence from fagen's output {found[5]:.3e})" if len(found) > 5 else ")"))
    return failures


def forward_failures(out, lse, q, k, v, causal, scale=None, window=(-1, -1), mods=NO_MODS):
    """What of fagen's out and LSE breaks the rule (empty: it passes); lse may be None."""
    return failures_of(forward_errors(out, lse, q, k, v, causal, scale, window, mods))


def gradient_failures(grads, q, k, v, dout, causal, scale=None, window=(-1, -1), out=None, mods=NO_MODS):
    """What of fagen's (dq, dk, dv[, dsink]) breaks the rule; a None gradient is not checked."""
    return failures_of(gradient_errors(grads, q, k, v, dout, causal, scale, out, window, mods))
