"""FA4 spec validation (sm100a): TMEM and shared-memory limits at spec time, new tile options."""

from __future__ import annotations

from functools import partial

import pydantic
import pytest

from fagen.codegen import render
from fagen.model import KernelSpec
from fagen.model.fa4 import TMEM_COLUMNS, Fa4Geometry, tmem_allocation
from spec_fields import refusal_of, spec_from

TILE = {"block_m": 128, "block_n": 128, "warps": 12, "stages": 2}


BASE = {"fa_version": 4, "arch": "sm100a", "dtype": "bf16", "head_dim": 128}
spec = partial(spec_from, BASE)
error_text = partial(refusal_of, BASE)


def test_auto_tile_uses_the_fa4_options():
    tile = spec().tile
    assert (tile.block_m, tile.warps) == (128, 12)
    assert tile.rescale_threshold == 8.0 and tile.exp2_emulation_period == 4


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm90a", "sm120"])
def test_fa4_needs_sm100a(arch):
    text = error_text(arch=arch, tile=TILE)
    assert f"arch={arch}" in text and "sm100a" in text


def test_tmem_overflow_is_rejected_naming_columns():
    # 2 x 256 (S) + 64 (O) = 576 columns > 512, even though block_n 256 is a legal MMA N.
    geometry = Fa4Geometry(64, 128, 256, 12, 2)
    assert geometry.tmem_columns_used == 576
    problems = geometry.problems(227 * 1024)
    assert problems and "block_n" in problems[0]
    text = error_text(head_dim=256, tile={**TILE, "stages": 2})
    assert "512" in text or "shared memory" in text


def test_tmem_limit_names_columns_when_it_is_the_only_problem(monkeypatch):
    monkeypatch.setattr("fagen.model.fa4.MAX_BLOCK_N", 256)
    problems = Fa4Geometry(128, 128, 256, 12, 2).problems(10**9)
    assert len(problems) == 1 and "640 TMEM columns" in problems[0] and str(TMEM_COLUMNS) in problems[0]


def test_shared_memory_overflow_is_rejected_naming_bytes():
    text = error_text(tile={**TILE, "stages": 4})
    assert "shared memory" in text and str(227 * 1024) in text


@pytest.mark.parametrize("field,value,needle", [
    ("block_m", 64, "tile.block_m=64"),
    ("warps", 10, "tile.warps=10"),
    ("block_n", 48, "tile.block_n=48"),
    ("stages", 1, "tile.stages=1"),
])
def test_bad_tile_fields_are_named(field, value, needle):
    assert needle in error_text(tile={**TILE, field: value})


def test_head_dim_must_be_whole_tma_boxes():
    assert "multiple of 64" in error_text(head_dim=96, tile=TILE)


def test_tmem_allocation_is_a_power_of_two():
    assert [tmem_allocation(c) for c in (1, 32, 33, 320, 384, 512)] == [32, 32, 64, 512, 512, 512]


def test_exp2_emulation_must_be_one_over_a_whole_number():
    assert "exp2_emulation=0.3" in error_text(tile={**TILE, "exp2_emulation": 0.3})
    assert spec(tile={**TILE, "exp2_emulation": 0.5}).tile.exp2_emulation_period == 2


def test_rescale_threshold_must_not_be_negative():
    assert "rescale_threshold" in error_text(tile={**TILE, "rescale_threshold": -1.0})


def test_options_name_the_kernel_and_reach_the_source():
    s = spec(tile={**TILE, "exp2_emulation": 0.25, "rescale_threshold": 8.0})
    assert "_e2p4_rt8_" in s.name
    source = render(s).source
    assert "kExp2EmulationPeriod = 4;" in source and "kRescaleThreshold = 8.0f;" in source
    assert "kConditionalRescale = true;" in source and "kTmemColumns = 512;" in source


def test_fa2_takes_the_options_and_fa2_and_fa3_refuse_each_others():
    # The softmax options ship with FA4 and stay on FA2, where the GPU tests run them on Hopper;
    # FA3 does not take them.
    fa2 = KernelSpec.model_validate({
        "fa_version": 2, "arch": "sm90", "dtype": "bf16", "head_dim": 64,
        "tile": {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2,
                 "exp2_emulation": 0.5, "rescale_threshold": 8.0}})
    source = render(fa2).source
    assert "kExp2EmulationPeriod = 2;" in source and "kConditionalRescale = true;" in source
    plain = KernelSpec.model_validate({"fa_version": 2, "arch": "sm90", "dtype": "bf16",
                                       "head_dim": 64})
    assert "kConditionalRescale = false;" in render(plain).source
    with pytest.raises(pydantic.ValidationError, match="tile.rescale_threshold"):
        KernelSpec.model_validate({
            "fa_version": 3, "arch": "sm90a", "dtype": "bf16", "head_dim": 128,
            "tile": {"block_m": 128, "block_n": 128, "warps": 12, "stages": 2,
                     "rescale_threshold": 8.0}})
    with pytest.raises(pydantic.ValidationError, match="tile.pingpong"):
        KernelSpec.model_validate({
            "fa_version": 2, "arch": "sm90", "dtype": "bf16", "head_dim": 64,
            "tile": {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2, "pingpong": True}})


BWD = {**BASE, "direction": "bwd"}


def test_backward_split_head_dims_take_steps_of_64_queries_and_a_transposed_dq():
    split = spec_from(BWD, head_dim=192, head_dim_v=128, mask="causal")
    g = split.geometry
    assert (g.block_m, g.dq_transposed, g.dq_products, g.dq_columns) == (64, True, 2, 128)
    # S^T 64, dP^T (and dQ^T's 128) from 64, dV 128 from 192, dK 192 from 320: all 512 columns.
    assert (g.tmem_dp_column, g.tmem_dv_column, g.tmem_dk_column, g.tmem_columns_used) == (64, 192, 320, 512)
    dense = spec_from(BWD, head_dim=128).geometry
    assert (dense.block_m, dense.dq_transposed, dense.tmem_dv_column, dense.tmem_columns_used) == (128, False, 256, 512)
    source = render(split).source
    assert "kDqTransposed = true" in source and "kTmemDkColumn = 320" in source


@pytest.mark.parametrize("dims,needle", [
    ({"head_dim": 256}, "FA2 backward serves the others"),
    ({"head_dim": 128, "head_dim_v": 64}, "(192, 128)"),
    ({"head_dim": 192, "head_dim_v": 128, "tile": {**TILE, "block_m": 128, "stages": 2}}, "TMEM columns"),
    ({"score": "softcap", "tile": {**TILE, "stages": 2}}, "score=softcap needs tile.block_m=64"),
    ({"head_dim": 64, "score": "softcap"}, "head_dim >= 128"),
])
def test_backward_refuses_what_tmem_cannot_hold(dims, needle):
    assert needle in refusal_of(BWD, **dims)



def test_backward_softcap_takes_the_64_query_step():
    g = spec_from(BWD, score="softcap", mask="causal").geometry
    assert (g.block_m, g.dq_transposed, g.dq_products, g.tmem_columns_used) == (64, True, 1, 384)
