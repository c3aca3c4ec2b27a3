"""The FA3 backward's model: what it accepts, what it refuses (with which message) and the
geometry its template re-checks; pure Python."""

from __future__ import annotations

from functools import partial

import pytest

from fagen.model import ARCHS
from fagen.model.fa3_bwd import Fa3BackwardSpec
from spec_fields import refusal_of, spec_from

TILE = {"block_n": 128, "warps": 12, "stages": 2}


BASE = {"fa_version": 3, "direction": "bwd", "arch": "sm90a", "dtype": "bf16", "head_dim": 128,
        "causal": True}
spec = partial(spec_from, BASE)
error_text = partial(refusal_of, BASE)


def test_auto_tile_is_the_fa3_backward():
    s = spec()
    assert isinstance(s, Fa3BackwardSpec)
    assert (s.tile.block_m, s.tile.block_n, s.tile.warps, s.tile.stages) == (64, 128, 12, 2)
    assert s.name.startswith("fa3_bwd_sm90a_bf16_hd128_causal_m64n128w12s2_ws_")
    assert s.launch().grid == "key_blocks"
    assert (s.launch().tma_q_rows, s.launch().tma_kv_rows) == (64, 128)


@pytest.mark.parametrize("head_dim", (96, 192))
def test_head_dims_outside_its_boxes_are_refused_by_name(head_dim):
    assert "takes (64, 128, 256)" in error_text(head_dim=head_dim, tile=TILE)


def test_head_dim_256_is_the_column_split():
    s = spec(head_dim=256)
    g = s.geometry
    assert (g.column_split, s.tile.block_n, s.launch().tma_kv_rows) == (True, 64, 64)
    assert g.key_split_registers > g.consumer_registers  # 256 for dK + dV alone
    assert g.estimated_registers <= g.consumer_registers
    # K, V 64 KB; 2 stages of Q, dO 128 KB; two P^T and two dS^T tiles 32 KB; dQ staged in the
    # ring: no staging tiles, and room for two stages.
    assert (g.dq_stage_bytes, g.pt_buffers, g.dq_barriers) == (0, 2, 4)
    assert g.smem_rows_offset == 64 * 1024 + 128 * 1024 + 32 * 1024
    assert g.smem_bytes <= ARCHS[s.arch].max_smem_per_block
    assert "must be 64 at head_dim=256" in error_text(head_dim=256, tile=TILE)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_smaller_head_dims_are_the_key_split(head_dim):
    g = spec(head_dim=head_dim).geometry
    assert (g.column_split, g.block_n_of_split, g.pt_buffers, g.dq_barriers) == (False, 128, 0, 4)


@pytest.mark.parametrize("field, value, words", [
    ("block_n", 64, "must be 128"), ("block_m", 128, "must be 64"), ("warps", 8, "must be 12"),
    ("stages", 4, "must be one of (2, 3)")])
def test_tile_fields_outside_the_structure_are_refused(field, value, words):
    assert words in error_text(tile={**TILE, field: value})


def test_only_sm90a():
    assert "sm90a only" in error_text(arch="sm90", tile=TILE)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_register_split_fits_what_the_cta_holds(head_dim):
    g = spec(head_dim=head_dim).geometry
    assert g.launch_registers == 168  # 64K / 384 threads, in granules of 8
    assert 32 + 2 * g.consumer_registers <= 3 * g.launch_registers
    assert g.estimated_registers <= g.consumer_registers


def test_shared_memory_layout():
    g = spec().geometry
    # K, V 64 KB; 2 stages of Q, dO 64 KB; two dS^T buffers 32 KB; two dQ staging tiles 32 KB.
    assert g.smem_rows_offset == 64 * 1024 + 64 * 1024 + 32 * 1024 + 32 * 1024
    assert all(offset % 1024 == 0 for offset in (g.smem_v_offset, g.smem_q_offset, g.smem_do_offset,
                                                  g.smem_ds_offset, g.smem_dq_offset, g.smem_rows_offset))
    assert g.smem_bytes <= ARCHS[spec().arch].max_smem_per_block
    assert (spec(head_dim=64).geometry.dq_stage_bytes, g.dq_stage_bytes) == (8 * 1024, 16 * 1024)
