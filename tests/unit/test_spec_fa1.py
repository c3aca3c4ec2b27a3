"""FA1 through the per-algorithm model: its tile, geometry, launch and template, no compiler."""

from __future__ import annotations

import pydantic
import pytest

from fagen import paths
from fagen.codegen import render
from fagen.model import KernelSpec, load_spec_file
from fagen.model.fa1 import Fa1ForwardSpec, Fa1Tile


def fa1(**overrides) -> KernelSpec:
    return KernelSpec.model_validate(
        {"fa_version": 1, "arch": "sm90", "dtype": "bf16", "head_dim": 128, **overrides})


def test_fa1_is_its_own_model_with_its_own_tile():
    spec = fa1(causal=True)
    assert isinstance(spec, Fa1ForwardSpec) and isinstance(spec.tile, Fa1Tile)
    assert spec.tile.model_dump() == {"block_m": 64, "block_n": 128, "warps": 4}
    assert spec.name.startswith("fa1_fwd_sm90_bf16_hd128_causal_m64n128w4_")


def test_fa1_launches_one_cta_per_head_with_a_workspace():
    launch = fa1().launch()
    assert (launch.grid, launch.threads, launch.block_m) == ("heads", 128, 64)
    # O (head_dim floats) and the running (max, sum) of every query row.
    assert launch.workspace_floats_per_row == 128 + 2
    assert launch.workspace_floats(seqlen_q=300, heads_q=4, batch=2) == 130 * 300 * 4 * 2
    assert launch.grid_dims(300, 4, 2, multiprocessors=132) == (4, 2, 1)


def test_fa1_geometry_two_q_buffers_and_one_kv_tile_pair():
    g = fa1().geometry
    pitch = 128 * 2 + 16
    assert g.row_pitch_bytes == pitch and g.smem_q_bytes == 64 * pitch
    assert g.smem_bytes == 2 * 64 * pitch + 2 * 128 * pitch


def test_fa1_falls_back_on_99_kb_parts():
    assert fa1(arch="sm90").tile.block_n == 128
    small = fa1(arch="sm86")
    assert small.tile.block_n == 64 and small.geometry.smem_bytes <= 99 * 1024


@pytest.mark.parametrize("tile, message", [
    ({"block_m": 128, "block_n": 64, "warps": 4}, "tile.block_m=128: must be 16 x warps = 64"),
    ({"block_m": 48, "block_n": 64, "warps": 3}, "tile.warps=3: must be one of (2, 4, 8)"),
    ({"block_m": 64, "block_n": 72, "warps": 4}, "tile.block_n=72: must be a multiple of 16"),
    ({"block_m": 64, "block_n": 64, "warps": 4, "stages": 2}, "stages"),
])
def test_fa1_tiles_that_cannot_work_are_refused(tile, message):
    with pytest.raises(pydantic.ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fa1(tile=tile)


def test_fa1_template_gets_its_constexprs_and_the_workspace_parameter():
    source = render(fa1()).source
    assert "static constexpr int kWorkspaceFloatsPerRow = 130;" in source
    assert "static constexpr int kWarpRows = 16;" in source
    assert "float* workspace)" in source and "fagen::fa1::Forward<Config>::run" in source


def test_lineage_spec_builds_fa1_fa2_and_fa3():
    expansion = load_spec_file(paths.specs_dir() / "lineage.yaml")
    versions = {(s.fa_version, s.arch.value) for s in expansion.specs}
    assert {(1, "sm80"), (1, "sm90"), (2, "sm80"), (2, "sm90"), (3, "sm90a")} <= versions
    fa1_keys = {s.lookup_key for s in expansion.specs if s.fa_version == 1}
    assert fa1_keys == {f"fwd/{d}/hd{h}/{m}" for d in ("fp16", "bf16") for h in (64, 128)
                        for m in ("full", "causal")}
