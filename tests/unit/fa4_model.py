"""A numpy model of the FA4 forward kernel's arithmetic (templates/include/fagen/fa4/forward.cuh).

No Blackwell GPU exists to run the kernel, so its math is checked here instead, step for step:
the same 128-row query blocks and key-block order (last block first), the same causal key
limits, scores and probabilities in fp32, P rounded to the input precision before P V (P is
stored to TMEM as 16-bit pairs), l summed from the unrounded probabilities, the same reference-
maximum rule (conditional rescaling), the same exp2 polynomial evaluated in fp32, and the final
O / l rounded to the input precision. numpy has no fused multiply-add, so the polynomial here
rounds once more per Horner step than the kernel's FFMAs: a difference of an fp32 ulp or two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BLOCK_M = 128
LOWEST_EXPONENT = -127.0  # at or below it the kernel's polynomial returns +0


def fit_exp2_polynomial(degree: int = 3, samples: int = 20000, iterations: int = 300) -> np.ndarray:
    """Coefficients c0..c_degree (c0 = 1) of the minimax-relative-error fit of 2^f on [0, 1).

    Lawson's iteratively reweighted least squares converges to the minimax solution; c0 is
    fixed to 1 so powers of two stay exact. Returns float32 coefficients, as the kernel uses.
    """
    f = np.linspace(0.0, 1.0, samples + 1)[1:]
    target = np.exp2(f)
    basis = np.stack([f**k for k in range(1, degree + 1)], axis=1) / target[:, None]
    rhs = (target - 1.0) / target
    weights = np.full_like(f, 1.0 / len(f))
    for _ in range(iterations):
        root = np.sqrt(weights)
        coeffs, *_ = np.linalg.lstsq(basis * root[:, None], rhs * root, rcond=None)
        weights *= np.abs(basis @ coeffs - rhs)
        weights /= weights.sum()
    return np.concatenate([[1.0], coeffs]).astype(np.float32)


def exp2_polynomial(x: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """The kernel's software 2^x in fp32: x = n + f, Horner on f, n added to the exponent bits."""
    x = np.maximum(np.asarray(x, dtype=np.float32), np.float32(LOWEST_EXPONENT))
    n = np.floor(x)
    frac = (x - n).astype(np.float32)
    p = np.full_like(frac, coeffs[-1])
    for c in coeffs[-2::-1]:
        p = (p * frac + c).astype(np.float32)
    bits = p.view(np.int32) + (n.astype(np.int32) << 23)
    return bits.view(np.float32)


def polynomial_relative_error(coeffs: np.ndarray, points: int = 1_000_000) -> float:
    f = np.linspace(0.0, 1.0, points + 1, dtype=np.float32)[:-1]
    approx = exp2_polynomial(f, coeffs).astype(np.float64)
    return float(np.max(np.abs(approx / np.exp2(f.astype(np.float64)) - 1.0)))


E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXPONENT = -6
E4M3_MANTISSA_BITS = 3
# e4m3's P: probabilities taken up to 2^8, e4m3's largest power of two below 448
# (algo/element.cuh: kProbabilityLog2Offset).
E4M3_PROBABILITY_LOG2_OFFSET = 8.0


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> bf16/fp16/e4m3 -> fp32, round to nearest even (as __floats2bfloat162_rn / _rn;
    e4m3 as __nv_cvt_float_to_fp8 with __NV_SATFINITE: past 448 saturates to 448)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "e4m3":
        magnitude = np.abs(x).astype(np.float64)
        with np.errstate(divide="ignore"):
            exponent = np.maximum(np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0))), E4M3_MIN_NORMAL_EXPONENT)
        step = np.exp2(exponent - E4M3_MANTISSA_BITS)
        rounded = np.minimum(np.round(magnitude / step) * step, E4M3_MAX)
        return (np.sign(x) * rounded).astype(np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def softmax_exp2(x: np.ndarray, period: int, coeffs: np.ndarray) -> np.ndarray:
    """Columns (2i, 2i+1) take the polynomial when i % period == period - 1 (period 0: never)."""
    out = np.exp2(x.astype(np.float32)).astype(np.float32)
    if period:
        pair = np.arange(x.shape[-1]) // 2
        emulated = pair % period == period - 1
        out[..., emulated] = exp2_polynomial(x[..., emulated], coeffs)
    return out


@dataclass
class ModelStats:
    """What the run did: how often O was rescaled, and the largest probability stored in P."""

    rescaled_rows: int = 0
    skipped_rows: int = 0
    max_probability: float = 0.0
    visited_blocks: list[int] = field(default_factory=list)


def softcap_tanh(x: np.ndarray) -> np.ndarray:
    """algo::softcap_tanh in fp32: 1 - 2 / (1 + 2^(2 x log2 e)), the exponent clamped at 64."""
    e = np.exp2(np.minimum((x * np.float32(2 * np.log2(np.e))).astype(np.float32), np.float32(64)))
    return (np.float32(1) - np.float32(2) / (np.float32(1) + e)).astype(np.float32)


def key_range(rows: np.ndarray, seqlen_q: int, seqlen_k: int, causal: bool,
              window: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """AttentionMask's [key_begin, key_end) of each row: causal is the right edge at 0, a window
    (left, right; -1 unbounded) both edges, bottom-right aligned."""
    offset = seqlen_k - seqlen_q
    left, right = window if window is not None else (-1, 0 if causal else -1)
    begin = np.zeros(len(rows), dtype=np.int64) if left < 0 else np.maximum(0, rows + offset - left)
    end = np.full(len(rows), seqlen_k) if right < 0 else np.minimum(seqlen_k, rows + offset + right + 1)
    return begin, end


def fa4_forward(q, k, v, *, causal: bool, block_n: int, dtype: str, scale: float | None = None,
                exp2_period: int = 0, rescale_threshold: float | None = None,
                coeffs: np.ndarray | None = None, stats: ModelStats | None = None,
                softcap: float = 0.0, alibi_slope: float | None = None, sink: float | None = None,
                window: tuple[int, int] | None = None):
    """O (seqlen_q, head_dim) and natural-log LSE (seqlen_q,) of one head, as the kernel computes.

    q, k, v hold values already representable in `dtype` (fp32 arrays). The score modifiers as
    algo/score.cuh applies them (softcap: u = tanh(s softmax_scale / softcap) with scale_log2 =
    softcap log2 e; ALiBi: the slope in u's units times the distance), the sink as the softmax
    warps' end does (algo::sink_term). `window` (left, right; -1 unbounded) is the local mask:
    a block of rows visits the key blocks between its first row's left edge and its last row's
    right edge.
    """
    coeffs = fit_exp2_polynomial() if coeffs is None else coeffs
    stats = ModelStats() if stats is None else stats
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    scale_log2 = np.float32((softcap if softcap > 0 else scale) * np.log2(np.e))
    # e4m3: P rounded to e4m3 after the offset (l carries it too), the output bf16.
    operand, output = (dtype, "bf16") if dtype == "e4m3" else (dtype, dtype)
    p_offset = np.float32(E4M3_PROBABILITY_LOG2_OFFSET if dtype == "e4m3" else 0.0)
    softcap_scale = np.float32(scale / softcap) if softcap > 0 else None
    slope_units = None if alibi_slope is None else np.float32(alibi_slope * (np.log2(np.e) / scale_log2))
    offset = seqlen_k - seqlen_q
    out = np.zeros((seqlen_q, head_dim), dtype=np.float32)
    lse = np.full(seqlen_q, -np.inf, dtype=np.float32)

    for row_begin in range(0, seqlen_q, BLOCK_M):
        rows = np.arange(row_begin, min(row_begin + BLOCK_M, seqlen_q))
        # AttentionMask::key_blocks over the whole block of rows (the kernel's rows past
        # seqlen_q included).
        block_rows = np.array([row_begin, row_begin + BLOCK_M - 1])
        first, last = key_range(block_rows, seqlen_q, seqlen_k, causal, window)
        block_begin, block_end = first[0] // block_n, -(-last[1] // block_n)
        n_blocks = block_end - block_begin
        stats.visited_blocks.append(max(n_blocks, 0))
        if n_blocks <= 0:
            continue  # write_empty_rows: O = 0, LSE = -inf
        key_begin, key_end = key_range(rows, seqlen_q, seqlen_k, causal, window)
        reference = np.full(len(rows), -np.inf, dtype=np.float32)
        row_sum = np.zeros(len(rows), dtype=np.float32)
        acc = np.zeros((len(rows), head_dim), dtype=np.float32)
        for j in range(n_blocks):
            n_block = block_end - 1 - j
            cols = n_block * block_n + np.arange(block_n)
            k_blk = np.zeros((block_n, head_dim), dtype=np.float32)  # TMA zero-fills past seqlen_k
            v_blk = np.zeros((block_n, head_dim), dtype=np.float32)
            valid = cols < seqlen_k
            k_blk[valid], v_blk[valid] = k[cols[valid]], v[cols[valid]]
            scores = (q[rows] @ k_blk.T).astype(np.float32)
            if softcap_scale is not None:
                scores = softcap_tanh((scores * softcap_scale).astype(np.float32))
            if slope_units is not None:
                distance = np.abs(rows[:, None] + offset - cols[None, :]).astype(np.float32)
                scores = (scores - slope_units * distance).astype(np.float32)
            scores[(cols[None, :] >= key_end[:, None]) | (cols[None, :] < key_begin[:, None])] = -np.inf
            block_max = np.maximum(reference, scores.max(axis=1))
            reference, rescale = next_reference_max(reference, block_max, scale_log2,
                                                    rescale_threshold, stats)
            subtrahend = np.where(reference == -np.inf, np.float32(0), reference * scale_log2) - p_offset
            exponent = (scores * scale_log2 - subtrahend[:, None]).astype(np.float32)
            probs = softmax_exp2(exponent, exp2_period, coeffs)
            stats.max_probability = max(stats.max_probability, float(probs.max()))
            row_sum = (row_sum * rescale + probs.sum(axis=1, dtype=np.float32)).astype(np.float32)
            acc = (acc * rescale[:, None]).astype(np.float32)  # the correction warps
            acc = (acc + round_to(probs, operand) @ v_blk).astype(np.float32)
        keys_top = np.where(reference == -np.inf, np.float32(0), reference * scale_log2).astype(np.float32)
        divisor = row_sum
        with np.errstate(divide="ignore"):
            lse_rows = np.where(row_sum == 0, -np.inf, (keys_top - p_offset + np.log2(row_sum)) * np.log(2))
        if sink is not None:  # the divisor l + 2^(sink - m2); the LSE against the larger reference
            sink_log2 = np.float32(sink * np.log2(np.e))
            with np.errstate(over="ignore"):
                divisor = (row_sum + np.exp2(sink_log2 - keys_top)).astype(np.float32)
            top = np.where(row_sum == 0, sink_log2, np.maximum(keys_top, sink_log2))
            keys = np.where(row_sum == 0, 0, np.exp2(keys_top - top))
            lse_rows = (top + np.log2(row_sum * keys + np.exp2(sink_log2 - top))) * np.log(2)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(divisor == 0, np.float32(0), np.float32(1) / divisor)
        out[rows] = round_to(acc * inv[:, None].astype(np.float32), output)
        lse[rows] = lse_rows
    if sink is not None:  # rows of a block that visits no key (write_empty_rows): the sink alone
        for row_begin in range(0, seqlen_q, BLOCK_M):
            first, last = key_range(np.array([row_begin, row_begin + BLOCK_M - 1]), seqlen_q, seqlen_k, causal, window)
            if -(-last[1] // block_n) <= first[0] // block_n:
                lse[row_begin:row_begin + BLOCK_M] = np.float32(sink)
    return out, lse


def next_reference_max(reference, block_max, scale_log2, threshold, stats):
    """algo::next_reference_max, row-wise: (new reference, rescale factor for O and l)."""
    if threshold is None:
        move = np.ones(len(reference), dtype=bool)
    else:
        with np.errstate(invalid="ignore"):
            move = (block_max - reference) * scale_log2 > threshold  # NaN (both -inf) -> False
    new_scaled = np.where(block_max == -np.inf, np.float32(0), block_max * scale_log2)
    with np.errstate(invalid="ignore"):
        factor = np.exp2((reference * scale_log2 - new_scaled).astype(np.float32))
    stats.rescaled_rows += int(np.sum(move & (reference != -np.inf)))
    stats.skipped_rows += int(np.sum(~move))
    return (np.where(move, block_max, reference).astype(np.float32),
            np.where(move, factor, np.float32(1)).astype(np.float32))


def modified_scores(scores, *, softcap: float = 0.0, alibi_slope: float | None = None):
    """flash-attn's score modifiers on scaled scores (seqlen_q, seqlen_k), in their dtype."""
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    if alibi_slope is not None:
        seqlen_q, seqlen_k = scores.shape
        distance = np.abs(np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q - np.arange(seqlen_k)[None, :])
        scores = scores - alibi_slope * distance.astype(scores.dtype)
    return scores


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None) -> np.ndarray:
    begin, end = key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window)
    keys = np.arange(seqlen_k)[None, :]
    return (keys >= begin[:, None]) & (keys < end[:, None])


def reference_attention(q, k, v, *, causal: bool, scale: float | None = None, softcap: float = 0.0,
                        alibi_slope: float | None = None, sink: float | None = None,
                        window: tuple[int, int] | None = None):
    """fp64 attention with bottom-right causal alignment and flash-attn's score modifiers (the
    sink a logit in every row's denominator); rows that see no key give 0 and -inf (the sink
    with one)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    scores = modified_scores(scale * (q @ k.T), softcap=softcap, alibi_slope=alibi_slope)
    scores = np.where(visible_pairs(seqlen_q, seqlen_k, causal, window), scores, -np.inf)
    if sink is not None:
        scores = np.concatenate([scores, np.full((seqlen_q, 1), float(sink))], axis=1)
        v = np.concatenate([v, np.zeros((1, head_dim))], axis=0)
    row_max = scores.max(axis=1, keepdims=True)
    empty = ~np.isfinite(row_max[:, 0])
    weights = np.exp(scores - np.where(empty[:, None], 0, row_max))
    total = weights.sum(axis=1, keepdims=True)
    out = np.where(empty[:, None], 0.0, weights @ v / np.where(empty[:, None], 1, total))
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, row_max[:, 0] + np.log(np.where(empty, 1, total[:, 0])))
    return out, lse


def low_precision_attention(q, k, v, *, causal: bool, dtype: str, scale: float | None = None,
                            softcap: float = 0.0, alibi_slope: float | None = None, sink: float | None = None,
                            window: tuple[int, int] | None = None):
    """Plain attention with every intermediate rounded to `dtype` (the 2x error baseline)."""
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    scores = round_to(round_to(q @ k.T, dtype) * np.float32(scale), dtype)
    scores = round_to(modified_scores(scores, softcap=softcap, alibi_slope=alibi_slope), dtype)
    scores = np.where(visible_pairs(seqlen_q, seqlen_k, causal, window), scores, -np.inf)
    if sink is not None:
        scores = np.concatenate([scores, np.full((seqlen_q, 1), round_to(np.float32(sink), dtype))], axis=1)
        v = np.concatenate([v, np.zeros((1, head_dim), dtype=np.float32)], axis=0)
    row_max = scores.max(axis=1, keepdims=True)
    empty = ~np.isfinite(row_max[:, 0])
    weights = np.exp(scores - np.where(empty[:, None], 0, row_max)).astype(np.float32)
    probs = round_to(weights / np.where(empty[:, None], 1, weights.sum(axis=1, keepdims=True)), dtype)
    return np.where(empty[:, None], 0.0, round_to(probs @ v, dtype))
