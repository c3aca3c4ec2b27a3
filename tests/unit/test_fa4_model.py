"""The FA4 kernel's math, checked in a numpy model against fp64 (no Blackwell GPU needed).

Rule (DESIGN.md): the model's max error against fp64 is at most 2x the error of plain attention
done in the low precision, plus a small atol.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from fagen import paths
from fa4_model import (
    ModelStats,
    exp2_polynomial,
    fa4_forward,
    fit_exp2_polynomial,
    low_precision_attention,
    polynomial_relative_error,
    reference_attention,
    round_to,
    visible_pairs,
)

ATOL = 1e-5
HEADER = paths.include_dir() / "fagen" / "algo" / "exp2_emulation.cuh"


@pytest.fixture(scope="module")
def coeffs():
    return fit_exp2_polynomial()


def inputs(seqlen_q, seqlen_k, head_dim, dtype, seed, spread=1.0):
    rng = np.random.default_rng(seed)
    q, k, v = (round_to(rng.standard_normal((n, head_dim)).astype(np.float32) * spread, dtype)
               for n in (seqlen_q, seqlen_k, seqlen_k))
    return q, k, v


def check(q, k, v, *, causal, dtype, block_n, coeffs, window=None, **options):
    out, lse = fa4_forward(q, k, v, causal=causal, block_n=block_n, dtype=dtype, coeffs=coeffs,
                           window=window, **options)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, window=window)
    baseline = low_precision_attention(q, k, v, causal=causal, dtype=dtype, window=window)
    error = np.max(np.abs(out - ref))
    allowed = 2 * np.max(np.abs(baseline - ref)) + ATOL
    assert error <= allowed, (error, allowed)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) < 1e-3
    return out, lse


def test_header_coefficients_are_the_fit(coeffs):
    text = HEADER.read_text()
    written = [float(x) for x in re.findall(r"kExp2PolyC\d = ([0-9.e-]+)f;", text)]
    assert np.allclose(written, coeffs[1:], rtol=0, atol=1e-7)


def test_polynomial_accuracy(coeffs):
    error = polynomial_relative_error(coeffs)
    assert error < 9e-5  # the header states 8.57e-5; bf16 rounds at 2^-9 = 2e-3
    x = np.array([-200.0, -np.inf, -127.0, -3.0, 0.0, 5.0, 8.0], dtype=np.float32)
    got = exp2_polynomial(x, coeffs)
    assert got[0] == 0 and got[1] == 0 and got[2] == 0
    assert np.array_equal(got[3:], np.exp2(x[3:]))  # powers of two are exact (p(0) = 1)
    spread = np.linspace(-60, 8, 100001, dtype=np.float32)
    assert np.max(np.abs(exp2_polynomial(spread, coeffs) / np.exp2(spread.astype(np.float64)) - 1)) < 1e-4


CASES = [  # (seqlen_q, seqlen_k, head_dim, causal)
    (1, 17, 64, False),
    (17, 17, 64, True),
    (300, 300, 128, True),
    (200, 77, 64, True),     # causal, seqlen_q > seqlen_k: the first 123 rows see no key
    (130, 1000, 128, False),
    (129, 260, 128, True),
]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}k{}d{}{}".format(*c[:3], "c" if c[3] else ""))
@pytest.mark.parametrize("exp2_period,threshold", [(0, None), (4, 8.0), (1, 8.0)])
def test_model_matches_fp64_within_twice_low_precision_error(case, dtype, exp2_period, threshold,
                                                               coeffs):
    seqlen_q, seqlen_k, head_dim, causal = case
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, dtype, seed=seqlen_q * 7 + seqlen_k)
    check(q, k, v, causal=causal, dtype=dtype, block_n=128, coeffs=coeffs,
          exp2_period=exp2_period, rescale_threshold=threshold)


def test_fully_masked_rows_give_zero_and_minus_inf(coeffs):
    q, k, v = inputs(200, 77, 64, "bf16", seed=3)
    out, lse = check(q, k, v, causal=True, dtype="bf16", block_n=64, coeffs=coeffs,
                     exp2_period=2, rescale_threshold=8.0)
    empty = np.arange(200) + 77 - 200 < 0
    assert empty.sum() == 123
    assert np.all(out[empty] == 0) and np.all(np.isneginf(lse[empty]))
    assert not np.any(np.isnan(out))


def test_causal_block_skipping_visits_only_blocks_left_of_the_diagonal(coeffs):
    q, k, v = inputs(512, 512, 64, "bf16", seed=4)
    stats = ModelStats()
    fa4_forward(q, k, v, causal=True, block_n=128, dtype="bf16", coeffs=coeffs, stats=stats)
    assert stats.visited_blocks == [1, 2, 3, 4]


WINDOWS = [  # (seqlen_q, seqlen_k, head_dim, (left, right), block_n)
    (300, 300, 128, (100, 0), 128),   # Mistral-like: causal with a left edge
    (257, 400, 64, (31, 17), 128),    # both edges, seqlen_k > seqlen_q
    (200, 77, 256, (8, 0), 64),       # head dim 256's tile; the first 123 rows see no key
    (130, 1000, 128, (2, 2), 128),    # five keys a row, most key blocks skipped
]


@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "q{}k{}d{}w{}-{}".format(*c[:3], *c[3]))
def test_windows_match_fp64_within_twice_low_precision_error(case, coeffs):
    """The local mask: both edges masked in the softmax warps, the key blocks between the first
    row's left edge and the last row's right edge visited (and no others)."""
    seqlen_q, seqlen_k, head_dim, window, block_n = case
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, "bf16", seed=seqlen_q + seqlen_k, spread=2.0)
    stats = ModelStats()
    out, lse = check(q, k, v, causal=False, dtype="bf16", block_n=block_n, coeffs=coeffs, window=window,
                     exp2_period=4, rescale_threshold=8.0, stats=stats)
    assert not np.any(np.isnan(out))
    full = -(-seqlen_k // block_n)
    assert max(stats.visited_blocks) < full or window[0] + window[1] + 128 >= seqlen_k


def test_window_visits_only_the_blocks_under_it(coeffs):
    q, k, v = inputs(512, 512, 64, "bf16", seed=14)
    stats = ModelStats()
    fa4_forward(q, k, v, causal=False, block_n=128, dtype="bf16", coeffs=coeffs, stats=stats, window=(100, 0))
    assert stats.visited_blocks == [1, 2, 2, 2]


def test_conditional_rescale_skips_most_rescales_and_stays_exact(coeffs):
    # Large scores make the row maximum jump between blocks: some rescales must happen, and
    # with threshold 8 most small increases are absorbed. Errors stay within the rule.
    q, k, v = inputs(256, 1024, 128, "bf16", seed=5, spread=2.0)
    always, conditional = ModelStats(), ModelStats()
    base, _ = check(q, k, v, causal=False, dtype="bf16", block_n=128, coeffs=coeffs,
                    rescale_threshold=None, stats=always)
    cond, _ = check(q, k, v, causal=False, dtype="bf16", block_n=128, coeffs=coeffs,
                    rescale_threshold=8.0, stats=conditional)
    assert conditional.rescaled_rows < always.rescaled_rows
    assert conditional.skipped_rows > 0
    assert always.max_probability <= 1.0 < conditional.max_probability <= 2.0**8
    # Same reference only changes which power of two O and l carry: results nearly identical.
    assert np.max(np.abs(base - cond)) <= 2 * np.max(np.abs(base)) * 2.0**-8


def test_threshold_zero_equals_always_rescaling(coeffs):
    q, k, v = inputs(130, 300, 64, "fp16", seed=6)
    a, la = fa4_forward(q, k, v, causal=True, block_n=64, dtype="fp16", coeffs=coeffs)
    b, lb = fa4_forward(q, k, v, causal=True, block_n=64, dtype="fp16", coeffs=coeffs,
                        rescale_threshold=0.0)
    assert np.array_equal(a, b) and np.allclose(la, lb)


MODIFIERS = {  # the score modifiers as flash_attn_func takes them (one head)
    "softcap": dict(softcap=30.0), "alibi": dict(alibi_slope=0.0625), "sink+": dict(sink=6.0),
    "sink-": dict(sink=-6.0), "all": dict(softcap=30.0, alibi_slope=0.0625, sink=2.0),
}


@pytest.mark.parametrize("modifier", MODIFIERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}k{}d{}{}".format(*c[:3], "c" if c[3] else ""))
def test_score_modifiers_match_fp64_within_twice_low_precision_error(case, modifier, coeffs):
    """The FA4 forward's softcap, ALiBi and sink arithmetic (the softmax warps' and their end's),
    with scores large enough (inputs x4) that the cap bends them."""
    seqlen_q, seqlen_k, head_dim, causal = case
    mods = MODIFIERS[modifier]
    q, k, v = inputs(seqlen_q, seqlen_k, head_dim, "bf16", seed=seqlen_q + 11 * seqlen_k, spread=4.0)
    out, lse = fa4_forward(q, k, v, causal=causal, block_n=128, dtype="bf16", coeffs=coeffs,
                           exp2_period=4, rescale_threshold=8.0, **mods)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, **mods)
    baseline = low_precision_attention(q, k, v, causal=causal, dtype="bf16", **mods)
    error, allowed = np.max(np.abs(out - ref)), 2 * np.max(np.abs(baseline - ref)) + ATOL
    assert error <= allowed, (error, allowed)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))  # with a sink no row's LSE is -inf
    finite = np.isfinite(ref_lse)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) < 1e-3


@pytest.mark.parametrize("head_dim,block_n", [(128, 128), (256, 64)])
def test_softcap_under_a_window(head_dim, block_n, coeffs):
    """Gemma-2's windowed layers: the softcap on the local kernels (head dims 128 and 256)."""
    q, k, v = inputs(300, 300, head_dim, "bf16", seed=head_dim, spread=4.0)
    mods = dict(softcap=30.0, window=(100, 0))
    out, _ = fa4_forward(q, k, v, causal=False, block_n=block_n, dtype="bf16", coeffs=coeffs, exp2_period=4,
                         rescale_threshold=8.0, **mods)
    ref, _ = reference_attention(q, k, v, causal=False, **mods)
    baseline = low_precision_attention(q, k, v, causal=False, dtype="bf16", **mods)
    assert np.max(np.abs(out - ref)) <= 2 * np.max(np.abs(baseline - ref)) + ATOL


def e4m3_emulation(q, k, v, *, causal, window=None):
    """Plain attention through FP8's quantisation steps (issue 25's bar): e4m3 inputs, scores and
    sums in fp32, P taken up to 2^8 and rounded to e4m3, P V in fp32, a bf16 output."""
    seqlen_q, head_dim = q.shape
    scores = (q @ k.T).astype(np.float32) * np.float32(1 / np.sqrt(head_dim))
    scores = np.where(visible_pairs(seqlen_q, k.shape[0], causal, window), scores, -np.inf)
    top = scores.max(axis=1, keepdims=True)
    empty = ~np.isfinite(top)
    with np.errstate(invalid="ignore"):
        probs = np.exp2(((scores - np.where(empty, 0, top)) * np.float32(np.log2(np.e))).astype(np.float32) + 8)
    probs = np.where(empty, 0, probs).astype(np.float32)
    total = probs.sum(axis=1, keepdims=True)
    out = (round_to(probs, "e4m3") @ v).astype(np.float32) / np.where(total == 0, 1, total)
    return round_to(out, "bf16")


E4M3_CASES = [  # (seqlen_q, seqlen_k, head_dim, causal, window, spread)
    (300, 300, 128, True, None, 1.0),
    (130, 1000, 128, False, None, 4.0),
    (200, 77, 256, True, None, 1.0),     # the first 123 rows see no key
    (257, 400, 128, False, (31, 17), 16.0),
    (129, 260, 256, True, None, 8.0),
]


@pytest.mark.parametrize("case", E4M3_CASES, ids=lambda c: "q{}k{}d{}{}x{}".format(c[0], c[1], c[2], "c" if c[3] else "", c[5]))
def test_e4m3_matches_fp64_within_twice_the_quantisation_emulation(case, coeffs):
    """The e4m3 forward: P offset to 2^8 and rounded to e4m3, l of the unrounded P, a bf16
    output, against fp64 on the same (dequantised) inputs; some inputs x100 (saturating at 448),
    none of it inf or NaN."""
    seqlen_q, seqlen_k, head_dim, causal, window, spread = case
    rng = np.random.default_rng(seqlen_q + seqlen_k + head_dim)
    q, k, v = (rng.standard_normal((n, head_dim)).astype(np.float32) * spread for n in (seqlen_q, seqlen_k, seqlen_k))
    q[rng.random(q.shape) < 0.002] *= 100  # outliers
    q, k, v = (round_to(t, "e4m3") for t in (q, k, v))
    assert np.max(np.abs(q)) <= 448
    stats = ModelStats()
    out, lse = fa4_forward(q, k, v, causal=causal, block_n=128, dtype="e4m3", coeffs=coeffs, exp2_period=4,
                           window=window, stats=stats)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, window=window)
    emulated = e4m3_emulation(q, k, v, causal=causal, window=window)
    error, allowed = np.max(np.abs(out - ref)), 2 * np.max(np.abs(emulated - ref)) + ATOL
    assert error <= allowed, (error, allowed)
    assert np.all(np.isfinite(out)) and stats.max_probability <= 2.0**8 * (1 + 1e-4)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) < 1e-3


def test_e4m3_rounding():
    x = np.array([0.0, 1.0, 1.0625, 1.125, 1.1875, 448.0, 464.0, 1e6, -3.3, 2.0**-9, 2.0**-10, 2.0**-6 * 1.0625])
    got = round_to(x, "e4m3")
    assert list(got[:5]) == [0.0, 1.0, 1.0, 1.125, 1.25]  # ties to even: 1.0625 -> 1.0, 1.1875 -> 1.25
    assert list(got[5:8]) == [448.0, 448.0, 448.0]  # saturates
    assert got[8] == -3.25 and got[9] == 2.0**-9 and got[10] == 0.0 and got[11] == 2.0**-6
