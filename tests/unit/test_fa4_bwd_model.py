"""The FA4 backward kernel's math and walk, checked in a numpy model against fp64 (no Blackwell
GPU needed).

Rule (DESIGN.md): each gradient's max error against fp64 is at most 3x the error of plain
attention's gradients done in the low precision, plus a small atol.
"""

from __future__ import annotations

import numpy as np
import pytest

from fa4_bwd_model import BLOCK_M, BLOCK_N, Band, WalkStats, fa4_backward, reference_gradients
from fa4_model import round_to

ATOL = 1e-5


def inputs(seqlen_q, seqlen_k, head_dim, dtype, seed, spread=1.0):
    rng = np.random.default_rng(seed)
    return tuple(round_to(rng.standard_normal((n, head_dim)).astype(np.float32) * s, dtype)
                 for n, s in ((seqlen_q, spread), (seqlen_k, spread), (seqlen_k, 1.0), (seqlen_q, 1.0)))


def check(seqlen_q, seqlen_k, head_dim, *, band, dtype="bf16", seed=0, spread=1.0, scale=None,
          alibi_slope=None, sink=None, stats=None):
    q, k, v, dout = inputs(seqlen_q, seqlen_k, head_dim, dtype, seed, spread)
    mods = dict(scale=scale, alibi_slope=alibi_slope)
    out, lse, *ref = reference_gradients(q, k, v, dout, band=band, sink=sink, **mods)
    *_, low_dq, low_dk, low_dv = reference_gradients(q, k, v, dout, band=band, sink=sink, dtype=dtype, **mods)
    got = fa4_backward(q, k, v, round_to(out.astype(np.float32), dtype), dout, lse.astype(np.float32),
                       band=band, dtype=dtype, stats=stats, **mods)
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


def test_model_blocks_are_the_kernels():
    from fagen.model import fa4_bwd

    assert (BLOCK_M, BLOCK_N) == (fa4_bwd.BLOCK_M, fa4_bwd.BLOCK_N)
