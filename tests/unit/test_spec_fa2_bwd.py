"""The FA2 backward's model: its warp tiles (one m16 tile of keys, or 32-key / 32-query warps),
what it refuses (with which message), the names and the geometry its template re-checks; pure
Python."""

from __future__ import annotations

from functools import partial

import pytest

from fagen.model import ARCHS
from fagen.model.fa2_bwd import Fa2BackwardSpec
from spec_fields import refusal_of, spec_from

WIDE = {"block_m": 64, "block_n": 128, "warps": 8, "stages": 2, "warp_keys": 32, "warp_queries": 32}


BASE = {"fa_version": 2, "direction": "bwd", "arch": "sm90", "dtype": "bf16", "head_dim": 128,
        "causal": False}
spec = partial(spec_from, BASE)
error_text = partial(refusal_of, BASE)


def test_one_tile_warps_keep_their_names_and_hold_p_in_registers():
    """warp_keys / warp_queries at 16 are the kernels shipped before the fields: no suffix, the
    same hash; with every query of a step in each warp, P^T never goes through shared memory."""
    s = spec(tile={"block_m": 64, "block_n": 128, "warps": 8, "stages": 2, "warp_keys": 16})
    assert isinstance(s, Fa2BackwardSpec)
    assert s.name == spec(tile={"block_m": 64, "block_n": 128, "warps": 8, "stages": 2}).name
    assert "_wk" not in s.name and "_wq" not in s.name
    g = s.geometry
    assert (g.key_groups, g.col_splits, g.probs_in_registers) == (8, 1, True)
    # K, V 2 x 34 KB; two stages of Q, dO (2 x 17 KB) and LSE, D; dS^T alone (128 x 144 B).
    assert g.smem_bytes == 2 * 128 * 272 + 2 * (2 * 64 * 272 + 2 * 64 * 4) + 128 * 144


def test_wide_warps_are_named_and_send_p_through_shared_memory():
    s = spec(tile=WIDE)
    assert "_m64n128w8s2_wk32_wq32_" in s.name
    g = s.geometry
    assert (g.key_groups, g.col_splits, g.s_cols, g.k_cols) == (4, 2, 32, 64)
    assert (g.query_groups, g.dq_splits, g.dq_cols) == (2, 4, 32)
    assert not g.probs_in_registers
    assert g.smem_bytes == 2 * 128 * 272 + 2 * (2 * 64 * 272 + 2 * 64 * 4) + 2 * 128 * 144
    constexprs = {c.name: c.value for c in s.algorithm_constexprs()}
    assert (constexprs["kWarpKeys"], constexprs["kWarpQueries"], constexprs["kProbsInRegisters"]) == (32, 32, False)


@pytest.mark.parametrize(("head_dim", "tile"), [
    (64, "m128n128w8s2_wk32_wq32"), (128, "m64n128w8s2_wk32_wq32"), (256, "m64n64w8s2_wk32_wq32"),
    (96, "m64n128w8s2"),  # 32-row dQ warps would hold 24 of head_dim 96's columns
])
def test_auto_tiles_on_sm90(head_dim, tile):
    s = spec(head_dim=head_dim)
    assert f"_{tile}_" in s.name
    assert s.geometry.smem_bytes <= ARCHS["sm90"].max_smem_per_block


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_sm80_takes_one_stage_of_the_same_warps(head_dim):
    s = spec(arch="sm80", head_dim=head_dim)
    assert s.tile.stages == 1 and s.tile.warp_keys == 32
    assert s.geometry.smem_bytes <= ARCHS["sm80"].max_smem_per_block


def test_refusals_name_the_field():
    assert "multiples of 16" in error_text(tile={**WIDE, "warp_keys": 24})
    assert "must be multiples of warp_queries=32 and warp_keys=64" in error_text(
        tile={**WIDE, "block_n": 96, "warp_keys": 64})
    # 96 / 32 = 3 groups of keys do not divide 8 warps.
    assert "3 groups of 32 keys must divide tile.warps=8" in error_text(tile={**WIDE, "block_n": 96})
    assert "24 dQ columns per warp" in error_text(head_dim=96, tile=WIDE)
