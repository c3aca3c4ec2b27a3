"""A numpy model of the FA4 backward kernel's arithmetic (templates/include/fagen/fa4/backward.cuh)
and of the row kernels around it (algo/backward_rows.cuh).

No Blackwell GPU exists to run the kernel, so its math and its walk are checked here instead,
step for step: a CTA per 128-key block, walking the query blocks (128 rows; 64 at head dims
192 / 128, whose dQ is then two transposed products over dims [0, 128) and [64, 192)) its keys
are seen by
(AttentionMask::query_blocks); S^T and dP^T in fp32; P^T = exp2(S^T scale_log2 - LSE2) in fp32
with ALiBi's bias in the score's units; masked pairs and queries past seqlen_q zeroed only on the
steps the kernel masks; P^T and dS^T rounded to the input precision before the products that read
them (they are stored to TMEM and shared memory as 16-bit values); dS^T from the fp32 P^T; dV, dK
and the dQ accumulator in fp32, dQ added per key block; dK and dQ scaled by softmax_scale at the
end and rounded. Rows and keys past the sequence are zero (TMA's fill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fa4_model import round_to

BLOCK_M = 128
SPLIT_BLOCK_M = 64
BLOCK_N = 128
MMA_M = 128
LOG2E = np.float32(np.log2(np.e))


@dataclass(frozen=True)
class Band:
    """The bottom-right aligned band of algo/mask.cuh: query row i sees keys j with
    i + offset - left <= j <= i + offset + right (None: unbounded), 0 <= j < seqlen_k."""

    left: int | None = None
    right: int | None = None

    @classmethod
    def of(cls, mask: str, window: tuple[int, int] = (-1, -1)) -> "Band":
        if mask == "full":
            return cls()
        if mask == "causal":
            return cls(None, 0)
        left, right = window
        return cls(None if left < 0 else left, None if right < 0 else right)

    def visible(self, rows: np.ndarray, keys: np.ndarray, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        offset = seqlen_k - seqlen_q
        rel = keys[None, :] - (rows[:, None] + offset)
        out = (keys[None, :] < seqlen_k) & (rows[:, None] < seqlen_q)
        if self.left is not None:
            out &= rel >= -self.left
        if self.right is not None:
            out &= rel <= self.right
        return out

    def query_blocks(self, key_begin: int, seqlen_q: int, seqlen_k: int, block_m: int = BLOCK_M) -> range:
        """AttentionMask::query_blocks: the blocks of rows that see a key of the block."""
        offset = seqlen_k - seqlen_q
        last_key = min(key_begin + BLOCK_N, seqlen_k) - 1
        first_row = 0 if self.right is None else max(0, key_begin - offset - self.right)
        row_end = seqlen_q if self.left is None else min(seqlen_q, last_key - offset + self.left + 1)
        return range(first_row // block_m, -(-row_end // block_m))

    def block_needs_mask(self, key_begin: int, row_begin: int, seqlen_q: int, seqlen_k: int,
                         block_m: int = BLOCK_M) -> bool:
        offset = seqlen_k - seqlen_q
        last_key = key_begin + BLOCK_N - 1
        needs = last_key >= seqlen_k or row_begin + block_m > seqlen_q
        if self.right is not None:
            needs |= last_key > row_begin + offset + self.right
        if self.left is not None:
            needs |= key_begin < row_begin + block_m - 1 + offset - self.left
        return needs


@dataclass
class WalkStats:
    """Which query blocks each key block walked, and how many of its steps masked."""

    walks: list[list[int]] = field(default_factory=list)
    masked_steps: int = 0


def alibi_bias(rows, keys, seqlen_q, seqlen_k, slope: float) -> np.ndarray:
    return -slope * np.abs(rows[:, None] + seqlen_k - seqlen_q - keys[None, :]).astype(np.float64)


def transposed_dq(k_blk, ds16, head_dim: int) -> np.ndarray:
    """dQ_i (queries x head_dim) from the kernel's dQ_i^T products: product j is K^T dS^T over the
    128 dims from first_dim(j) (the last one ending at head_dim), and lane l of it gives dim
    first_dim(j) + l unless an earlier product has that dim."""
    products = -(-head_dim // MMA_M)
    out = np.full((ds16.shape[1], head_dim), np.nan, dtype=np.float32)
    for j in range(products):
        first = j * MMA_M if j + 1 < products else head_dim - MMA_M
        lanes = (k_blk[:, first:first + MMA_M].T @ ds16).astype(np.float32)  # TMEM: lane = dim
        owned = first + np.arange(MMA_M) >= j * MMA_M
        out[:, first + np.flatnonzero(owned)] = lanes[owned].T
    assert not np.isnan(out).any(), "a dim no product's lane owns"
    return out


def fa4_backward(q, k, v, o, dout, lse, *, band: Band, dtype: str, scale: float | None = None,
                 alibi_slope: float | None = None, softcap: float | None = None, stats: WalkStats | None = None,
                 block_m: int = BLOCK_M):
    """dQ, dK, dV of one head as the three kernels compute them. q, k, v, o, dout hold values
    representable in `dtype` (fp32 arrays); lse is the forward's natural-log LSE (-inf for a row
    that sees no key). block_m < 128: the kernel's transposed dQ. softcap: u = tanh(s scale /
    softcap) in units of scale_log2 = softcap log2(e) (algo/score.cuh), dS^T times 1 - u^2."""
    stats = WalkStats() if stats is None else stats
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    scale = np.float32(1.0 / np.sqrt(head_dim) if scale is None else scale)
    scale_log2 = np.float32((scale if softcap is None else softcap) * LOG2E)
    # The preprocess: D = rowsum(dO * O) in fp32, LSE in base 2 (+inf for an empty row).
    dsum = np.sum(dout.astype(np.float32) * o.astype(np.float32), axis=1, dtype=np.float32)
    lse2 = np.where(np.isneginf(lse), np.float32(np.inf), (lse * LOG2E).astype(np.float32)).astype(np.float32)
    dq_accum = np.zeros((seqlen_q, head_dim), dtype=np.float32)
    dk = np.zeros((seqlen_k, head_dim), dtype=np.float32)
    dv = np.zeros((seqlen_k, v.shape[1]), dtype=np.float32)

    def tile(x, begin, rows):
        out = np.zeros((rows, x.shape[1]), dtype=np.float32)
        valid = x[begin:begin + rows]
        out[:len(valid)] = valid
        return out

    for key_begin in range(0, seqlen_k, BLOCK_N):
        keys = key_begin + np.arange(BLOCK_N)
        k_blk, v_blk = tile(k, key_begin, BLOCK_N), tile(v, key_begin, BLOCK_N)
        acc_dk = np.zeros((BLOCK_N, head_dim), dtype=np.float32)
        acc_dv = np.zeros((BLOCK_N, v.shape[1]), dtype=np.float32)
        blocks = band.query_blocks(key_begin, seqlen_q, seqlen_k, block_m)
        stats.walks.append(list(blocks))
        for m_block in blocks:
            row_begin = m_block * block_m
            rows = row_begin + np.arange(block_m)
            q_blk, do_blk = tile(q, row_begin, block_m), tile(dout, row_begin, block_m)
            clamped = np.minimum(rows, seqlen_q - 1)  # the compute warps' LSE and D reads
            s_t = (k_blk @ q_blk.T).astype(np.float32)
            dsoftcap = np.float32(1)
            if softcap is not None:
                s_t = np.tanh(s_t * np.float32(scale / softcap)).astype(np.float32)
                dsoftcap = (1 - s_t * s_t).astype(np.float32)
            if alibi_slope is not None:
                bias = alibi_bias(rows, keys, seqlen_q, seqlen_k, alibi_slope).T * LOG2E / scale_log2
                s_t = (s_t + bias.astype(np.float32)).astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                p_t = np.exp2((s_t * scale_log2 - lse2[clamped][None, :]).astype(np.float32)).astype(np.float32)
            if band.block_needs_mask(key_begin, row_begin, seqlen_q, seqlen_k, block_m):
                stats.masked_steps += 1
                p_t = np.where(band.visible(rows, keys, seqlen_q, seqlen_k).T, p_t, np.float32(0))
            dp_t = (v_blk @ do_blk.T).astype(np.float32)
            ds_t = (p_t * (dp_t - dsum[clamped][None, :]) * dsoftcap).astype(np.float32)
            p16, ds16 = round_to(p_t, dtype), round_to(ds_t, dtype)
            acc_dv = (acc_dv + p16 @ do_blk).astype(np.float32)
            acc_dk = (acc_dk + ds16 @ q_blk).astype(np.float32)
            dq_part = transposed_dq(k_blk, ds16, head_dim) if block_m < MMA_M else (ds16.T @ k_blk).astype(np.float32)
            valid = rows < seqlen_q
            dq_accum[rows[valid]] = (dq_accum[rows[valid]] + dq_part[valid]).astype(np.float32)
        end = min(key_begin + BLOCK_N, seqlen_k) - key_begin
        dk[key_begin:key_begin + end] = round_to(acc_dk[:end] * scale, dtype)
        dv[key_begin:key_begin + end] = round_to(acc_dv[:end], dtype)
    return round_to(dq_accum * scale, dtype), dk, dv


def reference_gradients(q, k, v, dout, *, band: Band, scale: float | None = None,
                        alibi_slope: float | None = None, softcap: float | None = None, sink: float | None = None,
                        dtype: str | None = None):
    """(O, LSE, dQ, dK, dV) of one head in fp64; with `dtype`, every intermediate rounded to it
    (plain attention in the low precision: the 3x error baseline). A sink is a logit in every
    row's denominator with a zero value row; the softcap is flash-attn's (softcap tanh(scaled
    score / softcap), before ALiBi's bias)."""
    rnd = (lambda x: round_to(x, dtype).astype(np.float64)) if dtype else (lambda x: x)
    q, k, v, dout = (np.asarray(t, dtype=np.float64) for t in (q, k, v, dout))
    seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    rows, keys = np.arange(seqlen_q), np.arange(seqlen_k)
    scores = rnd(rnd(q @ k.T) * scale)
    dsoftcap = 1.0
    if softcap is not None:
        capped = np.tanh(scores / softcap)
        dsoftcap = 1 - capped * capped
        scores = rnd(softcap * capped)
    if alibi_slope is not None:
        scores = rnd(scores + alibi_bias(rows, keys, seqlen_q, seqlen_k, alibi_slope))
    visible = band.visible(rows, keys, seqlen_q, seqlen_k)
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink)
    empty = ~np.isfinite(top[:, 0])
    top = np.where(empty[:, None], 0.0, top)
    weights = np.exp(scores - top)
    total = weights.sum(axis=1, keepdims=True) + (np.exp(sink - top) if sink is not None else 0.0)
    probs = rnd(np.where(empty[:, None], 0.0, weights / np.where(total == 0, 1, total)))
    out = rnd(probs @ v)
    with np.errstate(divide="ignore"):
        lse = np.where(empty | (total[:, 0] == 0), -np.inf, top[:, 0] + np.log(np.where(total[:, 0] == 0, 1, total[:, 0])))
    dv = rnd(probs.T @ dout)
    dp = rnd(dout @ v.T)
    ds = rnd(probs * (dp - np.sum(dp * probs, axis=1, keepdims=True)) * dsoftcap)
    dq = rnd(rnd(ds @ k) * scale)
    dk = rnd(rnd(ds.T @ q) * scale)
    return out, lse, dq, dk, dv
