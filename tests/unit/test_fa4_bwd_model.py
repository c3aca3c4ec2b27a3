"""The FA4 backward kernel's math and walk, checked in a numpy model against fp64 (no Blackwell
GPU needed).

Rule (DESIGN.md): each gradient's max error against fp64 is at most 3x the error of plain
attention's gradients done in the low precision, plus a small atol.
"""

from __future__ import annotations

import numpy as np
import pytest

from fa4_bwd_model import BLOCK_M, BLOCK_N, MMA_M, SPLIT_BLOCK_M, Band, WalkStats, fa4_backward, reference_gradients
from fa4_model import round_to

ATOL = 1e-5


def inputs(seqlen_q, seqlen_k, head_dim, dtype, seed, spread=1.0, head_dim_v=None):
    rng = np.random.default_rng(seed)
    dim_v = head_dim if head_dim_v is None else head_dim_v
    return tuple(round_to(rng.standard_normal((n, d)).astype(np.float32) * s, dtype)
                 for n, d, s in ((seqlen_q, head_dim, spread), (seqlen_k, head_dim, spread), (seqlen_k, dim_v, 1.0),
                                 (seqlen_q, dim_v, 1.0)))


def check(seqlen_q, seqlen_k, head_dim, *, band, dtype="bf16", seed=0, spread=1.0, scale=None,
          alibi_slope=None, softcap=None, sink=None, stats=None, head_dim_v=None, block_m=BLOCK_M):
    q, k, v, dout = inputs(seqlen_q, seqlen_k, head_dim, dtype, seed, spread, head_dim_v)
    mods = dict(scale=scale, alibi_slope=alibi_slope, softcap=softcap)
    out, lse, *ref = reference_gradients(q, k, v, dout, band=band, sink=sink, **mods)
    *_, low_dq, low_dk, low_dv = reference_gradients(q, k, v, dout, band=band, sink=sink, dtype=dtype, **mods)
    got = fa4_backward(q, k, v, round_to(out.astype(np.float32), dtype), dout, lse.astype(np.float32),
                       band=band, dtype=dtype, stats=stats, block_m=block_m, **mods)
    for name, g, r, low in zip(("dq", "dk", "dv"), got, ref, (low_dq, low_dk, low_dv)):
        assert np.all(np.isfinite(g)), name
        error, allowed = np.max(np.abs(g - r)), 3 * np.max(np.abs(low - r)) + ATOL
        assert error <= allowed, (name, error, allowed)
    return got


CASES = [  # (seqlen_q, seqlen_k, head_dim, band)
    (1, 17, 64, Band.of("full")),
    (17, 17, 64, Band.of("causal")),
    (300, 300, 128, Band.of("causal")),
    (200, 77, 64, Band.of("causal")),      # seqlen_q > seqlen_k: the first 123 rows see no key
    (130, 1000, 128, Band.of("full")),
    (129, 260, 128, Band.of("causal")),
    (300, 300, 64, Band.of("local", (100, 0))),  # a window: key blocks walk only its rows
    (257, 400, 128, Band.of("local", (31, 17))),
]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}k{}d{}".format(*c[:3]) + repr(c[3]))
def test_model_matches_fp64_within_three_times_low_precision_error(case, dtype):
    seqlen_q, seqlen_k, head_dim, band = case
    check(seqlen_q, seqlen_k, head_dim, band=band, dtype=dtype, seed=seqlen_q * 7 + seqlen_k)


@pytest.mark.parametrize("spread,scale", [(4.0, None), (16.0, None), (1.0, 2.0)])
def test_large_scores_and_few_visible_keys(spread, scale):
    """Inputs x4 and x16 and a large softmax_scale, under a window of 3 keys: rows whose few
    scores are large (the case that once gave inf / NaN gradients) stay finite and within 3x."""
    check(200, 200, 64, band=Band.of("local", (2, 0)), seed=11, spread=spread, scale=scale)
    check(150, 300, 128, band=Band.of("causal"), seed=12, spread=spread, scale=scale)


@pytest.mark.parametrize("mods", [dict(alibi_slope=0.0625), dict(sink=4.0), dict(sink=-4.0)],
                         ids=["alibi", "sink+", "sink-"])
def test_score_modifiers(mods):
    check(300, 300, 128, band=Band.of("causal"), seed=5, spread=2.0, **mods)
    check(200, 77, 64, band=Band.of("causal"), seed=6, **mods)


@pytest.mark.parametrize("case", [(300, 300, Band.of("causal"), 1.0), (257, 400, Band.of("local", (31, 0)), 1.0),
                                  (200, 200, Band.of("causal"), 8.0)], ids=["causal", "local", "x8"])
def test_softcap_in_steps_of_64_queries(case):
    """Gemma-2's softcap (50 at its scale; 5 here so that the scores reach the cap) at head dim
    128: 1 - u^2 per score, dQ^T from one product."""
    seqlen_q, seqlen_k, band, spread = case
    check(seqlen_q, seqlen_k, 128, band=band, block_m=SPLIT_BLOCK_M, softcap=5.0, spread=spread, seed=seqlen_q)
    check(seqlen_q, seqlen_k, 128, band=band, block_m=SPLIT_BLOCK_M, softcap=5.0, alibi_slope=0.0625, seed=seqlen_k)


def test_walk_visits_the_query_blocks_its_keys_are_seen_by():
    stats = WalkStats()
    check(512, 512, 64, band=Band.of("causal"), seed=7, stats=stats)
    assert stats.walks == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3]]
    assert stats.masked_steps == 4  # the diagonal blocks only
    stats = WalkStats()
    check(512, 512, 64, band=Band.of("local", (100, 0)), seed=8, stats=stats)
    assert stats.walks == [[0, 1], [1, 2], [2, 3], [3]]  # time follows the window


def test_rows_that_see_no_key_add_nothing():
    q, k, v, dout = inputs(200, 77, 64, "bf16", seed=9)
    band = Band.of("causal")
    out, lse, *_ = reference_gradients(q, k, v, dout, band=band)
    dq, dk, dv = fa4_backward(q, k, v, round_to(out.astype(np.float32), "bf16"), dout, lse.astype(np.float32),
                              band=band, dtype="bf16")
    empty = np.arange(200) + 77 - 200 < 0
    assert empty.sum() == 123 and np.all(dq[empty] == 0)
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


SPLIT_CASES = [  # DeepSeek-V3's 192 / 128: steps of 64 queries, dQ from two transposed products
    (1, 17, Band.of("full")),
    (65, 65, Band.of("causal")),
    (300, 300, Band.of("causal")),
    (130, 500, Band.of("full")),
    (200, 77, Band.of("causal")),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "q{}k{}".format(*c[:2]) + repr(c[2]))
def test_split_head_dims_with_transposed_dq(case):
    seqlen_q, seqlen_k, band = case
    check(seqlen_q, seqlen_k, 192, head_dim_v=128, block_m=SPLIT_BLOCK_M, band=band, seed=seqlen_q + 3 * seqlen_k)


def test_split_head_dims_at_large_scores():
    check(200, 200, 192, head_dim_v=128, block_m=SPLIT_BLOCK_M, band=Band.of("causal"), seed=13, spread=8.0)
    stats = WalkStats()
    check(256, 256, 192, head_dim_v=128, block_m=SPLIT_BLOCK_M, band=Band.of("causal"), seed=14, stats=stats)
    assert stats.walks == [[0, 1, 2, 3], [2, 3]]  # 64-row blocks: key block 1 starts at row 128


def test_model_blocks_are_the_kernels():
    from fagen.model import KernelSpec, fa4_bwd

    assert (BLOCK_M, SPLIT_BLOCK_M, BLOCK_N, MMA_M) == (fa4_bwd.BLOCK_M, fa4_bwd.SPLIT_BLOCK_M, fa4_bwd.BLOCK_N,
                                                       fa4_bwd.MMA_M)
    split = KernelSpec.model_validate({"fa_version": 4, "direction": "bwd", "arch": "sm100a", "dtype": "bf16",
                                       "head_dim": 192, "head_dim_v": 128, "mask": "causal"})
    assert split.geometry.block_m == SPLIT_BLOCK_M and split.geometry.dq_transposed
