"""Spec validation, naming and YAML expansion: pure Python, no compiler."""

from __future__ import annotations

from functools import partial

import pydantic
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fagen.model import ARCHS, SPEC_CLASSES, KernelSpec, SpecError, expand, load_spec_file
from fagen.model.arch import MAX_REGISTERS_PER_THREAD
from fagen.model.fa2 import Fa2Tile
from fagen.model.fa3 import Fa3Tile
from fagen.model.algorithms import SPEC_CLASSES

TABLE = tuple(row for spec in SPEC_CLASSES for row in spec.TUNING_ROWS)
from spec_fields import refusal_of, spec_from


BASE = {"fa_version": 2, "arch": "sm90", "dtype": "bf16", "head_dim": 128}
spec = partial(spec_from, BASE)
error_text = partial(refusal_of, BASE)


EXPLICIT_TILE = {"block_m": 64, "block_n": 64, "warps": 4, "stages": 2}


def test_head_dim_names_field_and_the_algorithms_limit():
    text = error_text(head_dim=100, tile=EXPLICIT_TILE)
    assert "head_dim=100" in text and "FA2 template needs a multiple of 16 up to 256" in text
    assert "multiple of 8" not in text  # the contract's looser limit would send the user to 72


@pytest.mark.parametrize("fa_version, arch, head_dim, words", [
    (1, "sm90", 72, "FA1 template needs a multiple of 16"),
    (3, "sm90a", 96, "FA3 template needs a multiple of 64"),
    (4, "sm100a", 320, "FA4 template needs a multiple of 64"),
])
def test_each_algorithm_names_its_own_head_dims(fa_version, arch, head_dim, words):
    assert words in error_text(fa_version=fa_version, arch=arch, head_dim=head_dim)


def test_head_dim_multiple_of_8_but_not_16_is_rejected_by_the_fa2_geometry():
    assert "multiple of 16" in error_text(head_dim=72, tile=EXPLICIT_TILE)


def test_fa3_on_sm80_is_rejected():
    text = error_text(fa_version=3, arch="sm80")
    assert "fa_version=3" in text


def test_fa2_on_sm90a_names_the_archs_it_runs_on():
    text = error_text(arch="sm90a")
    assert "arch=sm90a" in text and "sm90" in text


def test_tile_too_big_for_shared_memory_names_bytes_and_limit():
    tile = {"block_m": 128, "block_n": 128, "warps": 8, "stages": 2}
    text = error_text(arch="sm86", tile=tile)
    assert "shared memory" in text and str(99 * 1024) in text


def test_tile_needing_too_many_registers_names_the_limit():
    # 32 rows per warp at head_dim 256: O alone is 256 fp32 registers per thread.
    tile = {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2}
    text = error_text(head_dim=256, tile=tile)
    assert "registers" in text and str(MAX_REGISTERS_PER_THREAD) in text


def test_extra_field_is_forbidden():
    assert "softcap" in error_text(softcap=30.0)


def test_extra_tile_field_is_forbidden():
    tile = {"block_m": 128, "block_n": 64, "warps": 4, "stages": 2, "pingpong": True}
    assert "pingpong" in error_text(tile=tile)


def test_spec_is_frozen():
    s = spec()
    with pytest.raises(pydantic.ValidationError):
        s.head_dim = 64


@settings(max_examples=200, deadline=None)
@given(
    head_dim=st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=5),
                       st.none()),
    block_m=st.integers(-(2**20), 2**20),
    block_n=st.integers(-(2**20), 2**20),
    warps=st.integers(-64, 64),
    stages=st.integers(-8, 8),
    arch=st.sampled_from(["sm80", "sm86", "sm89", "sm90", "sm90a", "sm100a", "sm120", "sm75", ""]),
)
def test_random_input_fails_only_with_validation_error(head_dim, block_m, block_n, warps, stages, arch):
    tile = {"block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages}
    try:
        KernelSpec.model_validate(
            {"fa_version": 2, "arch": arch, "dtype": "fp16", "head_dim": head_dim, "tile": tile}
        )
    except pydantic.ValidationError:
        pass


@settings(max_examples=100, deadline=None)
@given(head_dim=st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True)),
       arch=st.sampled_from(["sm80", "sm86", "sm90", "sm120"]))
def test_random_head_dim_with_auto_tile_fails_only_with_validation_error(head_dim, arch):
    try:
        KernelSpec.model_validate(
            {"fa_version": 2, "arch": arch, "dtype": "bf16", "head_dim": head_dim, "tile": "auto"}
        )
    except pydantic.ValidationError:
        pass


def test_name_is_pinned():
    """A change here renames shipped kernels: bump it only on purpose."""
    s = spec(causal=True, tile={"block_m": 128, "block_n": 64, "warps": 4, "stages": 2})
    assert s.name == "fa2_fwd_sm90_bf16_hd128_causal_m128n64w4s2_8f25a6ba"
    assert s.lookup_key == "fwd/bf16/hd128/causal"


def test_name_ignores_field_order_and_auto_equals_explicit_tile():
    auto = spec()
    explicit = KernelSpec.model_validate(
        {"tile": auto.tile.model_dump(), "head_dim": 128, "dtype": "bf16", "arch": "sm90",
         "fa_version": 2}
    )
    assert auto.name == explicit.name


def rows_of(tile_model, max_head_dim, causal=None):
    return [r for r in TABLE if type(r.tile) is tile_model and r.max_head_dim == max_head_dim
            and (causal is None or r.causal in (None, causal)) and r.score is None
            and r.head_dim_v is None and r.mask is None and r.layout is None and "bf16" in r.dtypes]


def test_auto_tile_follows_the_tuning_table():
    row = rows_of(Fa2Tile, 128)[0]
    assert spec(head_dim=128, arch="sm90").tile == row.tile


def test_every_tuning_row_fits_a_target_of_its_algorithm():
    for row in TABLE:
        algorithm = next(c for c in SPEC_CLASSES if c.model_fields["tile"].annotation is type(row.tile))
        fits = [arch for arch in algorithm.ARCHS for dtype in row.dtypes
                if not algorithm.geometry_of(row.max_head_dim, row.tile, row.head_dim_v, dtype).problems(
                    ARCHS[arch].max_smem_per_block)]
        assert fits, f"{row.tile!r} fits no target of {algorithm.__name__}"


def test_auto_tile_falls_back_on_small_shared_memory_parts():
    big, small = spec(head_dim=256, arch="sm90"), spec(head_dim=256, arch="sm86")
    assert big.geometry.smem_bytes > 99 * 1024 >= small.geometry.smem_bytes
    for head_dim in (64, 96, 128, 192, 256):
        assert spec(head_dim=head_dim, arch="sm86").geometry.smem_bytes <= 99 * 1024


def test_auto_tile_adds_the_tuning_tables_short_sequence_kernels():
    expansion = expand({"bundle": "t", "kernels": [
        {"fa_version": 3, "arch": "sm90a", "dtype": "bf16", "head_dim": 64, "causal": True}]})
    by_bound = {s.max_seqlen_k: s for s in expansion.specs}
    rows = rows_of(Fa3Tile, 64, causal=True)
    assert set(by_bound) == {r.max_seqlen_k for r in rows}
    for row in rows:
        assert by_bound[row.max_seqlen_k].tile == row.tile
    bound = min(b for b in by_bound if b is not None)
    assert by_bound[bound].name.split("_")[-2] == f"upto{bound}"
    assert "max_seqlen_k" not in by_bound[None].canonical_json()  # unbounded names unchanged


def test_explicit_tile_or_bound_builds_one_kernel():
    entry = {"fa_version": 3, "arch": "sm90a", "dtype": "bf16", "head_dim": 64, "causal": True}
    explicit_tile = expand({"bundle": "t", "kernels": [
        {**entry, "tile": {"block_m": 128, "block_n": 128, "warps": 12, "stages": 2}}]})
    assert [s.max_seqlen_k for s in explicit_tile.specs] == [None]
    # An explicit bound with `tile: auto` takes the table's tile for that length.
    (short,) = expand({"bundle": "t", "kernels": [{**entry, "max_seqlen_k": 300}]}).specs
    row = min((r for r in rows_of(Fa3Tile, 64, causal=True) if r.max_seqlen_k is not None),
              key=lambda r: r.max_seqlen_k)
    assert short.max_seqlen_k == 300 and short.tile == row.tile


def test_a_rejected_combination_is_skipped_once_with_its_bounds():
    expansion = expand({"bundle": "t", "kernels": [
        {"fa_version": 3, "arch": ["sm80", "sm90a"], "dtype": "bf16", "head_dim": 64, "causal": True}]})
    assert len(expansion.skipped) == 1 and expansion.skipped[0][1]["arch"] == "sm80"
    assert {s.arch.value for s in expansion.specs} == {"sm90a"} and len(expansion.specs) > 1


def test_product_expands_and_reports_skips():
    expansion = expand({
        "bundle": "t",
        "kernels": [{"fa_version": 2, "arch": ["sm80", "sm90a"], "dtype": ["fp16", "bf16"],
                     "head_dim": 64, "causal": [False, True]}],
    })
    assert len(expansion.specs) == 4
    assert {s.arch.value for s in expansion.specs} == {"sm80"}
    assert len(expansion.skipped) == 4
    index, fields, why = expansion.skipped[0]
    assert index == 0 and fields["arch"] == "sm90a" and "arch=sm90a" in why


def test_duplicates_are_dropped_and_specs_sorted_by_name():
    entry = {"fa_version": 2, "arch": "sm80", "dtype": "fp16", "head_dim": 64}
    expansion = expand({"bundle": "t", "kernels": [entry, dict(entry)]})
    assert len(expansion.specs) == 1


def test_invalid_single_variant_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "bundle": "t",
        "kernels": [{"fa_version": 2, "arch": "sm80", "dtype": "fp16", "head_dim": 64},
                    {"fa_version": 2, "arch": "sm90a", "dtype": "fp16", "head_dim": 64}],
    }))
    with pytest.raises(SpecError, match=r"bad\.yaml.*kernels\[1\].*arch=sm90a"):
        load_spec_file(path)


def test_unknown_top_level_key_and_bad_bundle_name_are_errors():
    with pytest.raises(SpecError, match="extra"):
        expand({"bundle": "t", "kernels": [], "extra": 1})
    with pytest.raises(SpecError, match="bundle"):
        expand({"bundle": "../escape", "kernels": []})


def test_included_spec_files_join_the_bundle(tmp_path):
    entry = {"fa_version": 2, "arch": "sm80", "dtype": "fp16", "head_dim": 64}
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "extra.yaml").write_text(yaml.safe_dump(
        {"bundle": "extra", "kernels": [{**entry, "head_dim": 128}, entry]}))
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(
        {"bundle": "main", "include": ["more/extra.yaml"], "kernels": [entry]}))
    expansion = load_spec_file(tmp_path / "main.yaml")
    assert expansion.bundle == "main"
    assert sorted(s.head_dim for s in expansion.specs) == [64, 128]  # the shared entry once


def test_a_spec_file_that_includes_itself_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"bundle": "a", "include": ["b.yaml"], "kernels": []}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"bundle": "b", "include": ["a.yaml"], "kernels": []}))
    with pytest.raises(SpecError, match="a.yaml includes itself"):
        load_spec_file(tmp_path / "a.yaml")
    with pytest.raises(SpecError, match="no such spec file"):
        expand({"bundle": "c", "include": ["absent.yaml"], "kernels": []}, tmp_path)


def test_missing_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec_file(tmp_path / "absent.yaml")


def test_fa2_one_stage_halves_the_kv_shared_memory():
    tile = {"block_m": 128, "block_n": 64, "warps": 8}
    one, two = (spec(head_dim=256, tile={**tile, "stages": s}).geometry for s in (1, 2))
    assert two.smem_bytes - one.smem_bytes == one.smem_kv_stage_bytes
    assert "stages" in error_text(head_dim=256, tile={**tile, "stages": 0})


FA3_TILE = {"block_n": 128, "stages": 2}


def test_fa3_three_consumer_warpgroups_split_the_registers():
    three = spec(fa_version=3, arch="sm90a", head_dim=64,
                 tile={**FA3_TILE, "block_m": 192, "warps": 16}).geometry
    two = spec(fa_version=3, arch="sm90a", head_dim=64,
               tile={**FA3_TILE, "block_m": 128, "warps": 12}).geometry
    # 24 (producer) + 3 x 160 and 24 + 2 x 240 thread-slots of 128 threads: 504 x 128 <= 64K.
    assert (three.consumers, three.consumer_registers) == (3, 160)
    assert (two.consumers, two.consumer_registers) == (2, 240)


def test_fa3_paged_hd64_producer_gathers_with_more_registers():
    """The paged layout at head_dim_v 64 gathers 16-key pages with all 128 producer threads
    (algo/cache_gather.cuh): 88 registers for them, 208 for each consumer; the other layouts
    and head dims keep the one-thread TMA producer's 24 (and 240)."""
    tile = {**FA3_TILE, "block_m": 128, "warps": 12}
    paged = spec(fa_version=3, arch="sm90a", head_dim=64, mask="local", layout="paged", tile=tile)
    dense = spec(fa_version=3, arch="sm90a", head_dim=64, mask="local", tile=tile)
    paged_128 = spec(fa_version=3, arch="sm90a", head_dim=128, mask="local", layout="paged", tile=tile)
    assert paged.geometry.gathers_kv and not dense.geometry.gathers_kv and not paged_128.geometry.gathers_kv
    assert (paged.geometry.producer_registers, paged.geometry.consumer_registers) == (88, 208)
    assert (dense.geometry.producer_registers, dense.geometry.consumer_registers) == (24, 240)
    assert (paged_128.geometry.producer_registers, paged_128.geometry.consumer_registers) == (24, 240)
    constexprs = {c.name: c.value for c in paged.algorithm_constexprs()}
    assert (constexprs["kGathersKv"], constexprs["kProducerRegisters"], constexprs["kConsumerRegisters"]) == \
        (True, 88, 208)


def test_fa3_one_consumer_tiles_are_gone():
    # Two CTAs per SM of one consumer each measured below the two-consumer tiles (run 23).
    text = error_text(fa_version=3, arch="sm90a", head_dim=64,
                      tile={**FA3_TILE, "block_m": 64, "warps": 8})
    assert "tile.block_m=64: must be 128 or 192" in text


@pytest.mark.parametrize("flag", ("warp_specialized", "intra_wg_overlap", "persistent"))
def test_fa3_structure_is_accepted_only_as_what_every_kernel_does(flag):
    tile = {**FA3_TILE, "block_m": 128, "warps": 12}
    same = spec(fa_version=3, arch="sm90a", head_dim=64, tile={**tile, flag: True})
    assert same == spec(fa_version=3, arch="sm90a", head_dim=64, tile=tile)
    assert same.tile.model_dump()[flag] is True  # in the canonical JSON, hence the names
    text = error_text(fa_version=3, arch="sm90a", head_dim=64, tile={**tile, flag: False})
    assert f"tile.{flag}: every fa3 fwd kernel has {flag}=True" in text


def test_fa3_four_consumer_warpgroups_are_rejected():
    text = error_text(fa_version=3, arch="sm90a", head_dim=64,
                      tile={**FA3_TILE, "block_m": 256, "warps": 20})
    assert "block_m=256" in text and "three" in text


def test_fa3_three_consumers_reject_a_block_that_needs_more_than_160_registers():
    text = error_text(fa_version=3, arch="sm90a", head_dim=128,
                      tile={**FA3_TILE, "block_m": 192, "warps": 16})
    assert "registers" in text and "160" in text


EARLY_FIRST_QK_TILE = {**FA3_TILE, "block_m": 128, "warps": 12, "early_first_qk": True}


def test_fa3_early_first_qk_is_named_and_loads_q_a_tile_ahead():
    early = spec(fa_version=3, arch="sm90a", head_dim=64, tile=EARLY_FIRST_QK_TILE)
    plain = spec(fa_version=3, arch="sm90a", head_dim=64,
                 tile={**EARLY_FIRST_QK_TILE, "early_first_qk": False})
    assert "_fq_" in early.name and "_fq" not in plain.name
    q_tile = 128 * 64 * 2
    assert (early.geometry.q_stages, early.geometry.smem_k_offset) == (2, 2 * q_tile)
    assert (plain.geometry.q_stages, plain.geometry.smem_k_offset) == (1, q_tile)
    # Two more mbarriers (the second Q stage's full and empty).
    assert early.geometry.smem_bytes == plain.geometry.smem_bytes + q_tile + 2 * 8


def test_fa3_early_first_qk_is_refused_with_pingpong():
    text = error_text(fa_version=3, arch="sm90a", head_dim=64,
                      tile={**EARLY_FIRST_QK_TILE, "pingpong": True})
    assert "tile.early_first_qk: not with pingpong" in text


def test_fa3_early_first_qk_is_refused_where_a_second_q_buffer_does_not_fit():
    tile = {**EARLY_FIRST_QK_TILE, "block_n": 64}
    assert spec(fa_version=3, arch="sm90a", head_dim=256,
                tile={**tile, "early_first_qk": False}).geometry.smem_bytes < 227 * 1024
    text = error_text(fa_version=3, arch="sm90a", head_dim=256, tile=tile)
    assert "shared memory" in text


def test_fa3_peel_masked_blocks_is_named():
    tile = {**FA3_TILE, "block_m": 128, "warps": 12, "peel_masked_blocks": True}
    assert "_ov_ps_pm_" in spec(fa_version=3, arch="sm90a", head_dim=64, tile=tile).name


def test_fa3_mma_row_sum_is_named_and_puts_ones_beside_each_v_stage():
    tile = {**FA3_TILE, "block_m": 128, "warps": 12}
    plain = spec(fa_version=3, arch="sm90a", head_dim=64, tile=tile).geometry
    summed = spec(fa_version=3, arch="sm90a", head_dim=64, tile={**tile, "mma_row_sum": True})
    assert "_ps_ms_" in summed.name
    g = summed.geometry
    assert (plain.pv_columns, g.pv_columns) == (64, 72)
    # One 64-column chunk of block_n rows (128 bytes each) per V stage, after the V tile.
    assert g.smem_v_stage_bytes == plain.smem_kv_tile_bytes + 128 * 128
    assert g.smem_bytes - plain.smem_bytes == 2 * 128 * 128


def test_fa3_mma_row_sum_is_refused_past_the_widest_wgmma():
    tile = {**FA3_TILE, "block_n": 64, "block_m": 128, "warps": 12, "mma_row_sum": True}
    text = error_text(fa_version=3, arch="sm90a", head_dim=256, tile=tile)
    assert "mma_row_sum" in text and "264" in text


def test_mask_field_and_causal_shorthand():
    assert spec(causal=True).mask == "causal" and spec(causal=False).mask == "full"
    local = spec(mask="local")
    assert local.mask == "local" and local.lookup_key == "fwd/bf16/hd128/local"
    assert "_local_" in local.name and "causal" not in local.canonical_json()
    # full and causal keep the names they had before masks had kinds (test_name_is_pinned)
    assert '"causal":true' in spec(mask="causal").canonical_json()
    assert spec(mask="causal").name == spec(causal=True).name
    with pytest.raises(pydantic.ValidationError, match="causal=true and mask=local disagree"):
        spec(causal=True, mask="local")
    with pytest.raises(pydantic.ValidationError, match="mask"):
        spec(mask="sliding")


def test_fa1_names_the_masks_it_lacks_and_fa4_takes_windows():
    with pytest.raises(pydantic.ValidationError, match="fa_version=1 fwd has the full, causal masks only"):
        KernelSpec.model_validate({"fa_version": 1, "arch": "sm80", "dtype": "bf16", "head_dim": 64,
                                   "mask": "local"})
    for direction in ("fwd", "bwd"):
        spec = KernelSpec.model_validate({"fa_version": 4, "direction": direction, "arch": "sm100a", "dtype": "bf16",
                                          "head_dim": 128, "mask": "local"})
        assert spec.mask == "local"


def test_the_tuning_module_imports_no_algorithm():
    # Each algorithm owns its tuning rows (its TUNING, beside its model); the resolver imports
    # none of the algorithm modules, so the model package has no import cycle through it.
    import ast
    import inspect

    import fagen.model.tuning as tuning

    tree = ast.parse(inspect.getsource(tuning))  # run-time imports: the module's top level
    imported = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert not any(name and name.startswith(("fa", "base", "algorithms")) for name in imported), imported


def test_the_score_field_takes_the_keys_spelling():
    base = {"fa_version": 2, "arch": "sm90", "dtype": "bf16", "head_dim": 64, "mask": "local"}
    capped = KernelSpec.model_validate({**base, "score": "sinks+softcap"})
    assert capped.score == ("softcap", "sinks") and capped.lookup_key == "fwd/bf16/hd64/local+softcap+sinks"
    assert "_local_softcap_sinks_" in capped.name
    plain = KernelSpec.model_validate({**base, "score": "none"})
    assert plain.score == () and "score" not in plain.canonical_json()  # names without it unchanged
    constexprs = {c.name: c.value for c in capped.constexprs()}
    assert (constexprs["kSoftcap"], constexprs["kAlibi"], constexprs["kSinks"]) == (True, False, True)
    with pytest.raises(ValueError, match="each modifier once"):
        KernelSpec.model_validate({**base, "score": "softcap+softcap"})
    with pytest.raises(ValueError, match="fa_version=1 fwd takes none"):
        KernelSpec.model_validate({"fa_version": 1, "arch": "sm80", "dtype": "bf16", "head_dim": 64,
                                   "score": "softcap"})


def test_a_variant_takes_its_own_tuning_row_before_the_general_one():
    base = {"fa_version": 3, "arch": "sm90a", "dtype": "bf16", "head_dim": 128}
    general = KernelSpec.model_validate(base).tile
    capped = KernelSpec.model_validate({**base, "score": "softcap"}).tile
    assert general.pingpong and general.block_n == 160
    assert not capped.pingpong and capped.block_n == 128  # the ping-pong tile spilled with the softcap
    expansion = expand({"bundle": "t", "kernels": [{**base, "causal": True, "score": "softcap"}]})
    assert [s.max_seqlen_k for s in expansion.specs] == [None]  # no short-sequence kernels per variant


@pytest.mark.parametrize("fa_version, direction, arch", [
    (2, "fwd", "sm80"), (2, "bwd", "sm90"), (3, "fwd", "sm90a"), (4, "fwd", "sm100a")])
def test_split_head_dims_reach_the_name_the_key_and_the_template(fa_version, direction, arch):
    spec = KernelSpec.model_validate({"fa_version": fa_version, "direction": direction, "arch": arch,
                                      "dtype": "bf16", "head_dim": 192, "head_dim_v": 128, "causal": True})
    assert spec.lookup_key == f"{direction}/bf16/hd192v128/causal"
    assert "_hd192v128_causal_" in spec.name
    constexprs = {c.name: c.value for c in spec.constexprs()}
    assert (constexprs["kHeadDim"], constexprs["kHeadDimV"]) == (192, 128)
    assert spec.geometry.head_dim_v == 128


def test_one_head_dim_given_twice_is_the_kernel_with_one():
    one = KernelSpec.model_validate({**BASE, "causal": True})
    twice = KernelSpec.model_validate({**BASE, "causal": True, "head_dim_v": 128})
    assert twice == one and twice.name == one.name and "head_dim_v" not in twice.canonical_json()
    assert {c.name: c.value for c in one.constexprs()}["kHeadDimV"] == 128


@pytest.mark.parametrize("fields, words", [
    ({"head_dim_v": 100}, "head_dim_v=100: must be a multiple of 8"),
    ({"head_dim": 64, "head_dim_v": 128}, "needs head_dim_v <= head_dim"),
    ({"fa_version": 1, "arch": "sm80", "head_dim_v": 64}, "fa_version=1 fwd cannot take it"),
    ({"fa_version": 3, "direction": "bwd", "arch": "sm90a", "head_dim_v": 64}, "the FA2 backward takes head_dim_v"),
    ({"fa_version": 4, "arch": "sm100a", "head_dim": 64, "head_dim_v": 128}, "the epilogue stages O through the Q tile"),
])
def test_split_head_dims_an_algorithm_cannot_take_are_refused_by_name(fields, words):
    assert words in error_text(**fields)


DOCUMENT_HEADER = "struct DocumentMask {};  // a stand-in: the kernel model reads no C++\n"


def write_mask_spec(tmp_path, header=DOCUMENT_HEADER, kernels=None):
    (tmp_path / "document.cuh").write_text(header)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "bundle": "masks", "masks": {"document": {"header": "document.cuh", "type": "DocumentMask"}},
        "kernels": kernels or [{"fa_version": 3, "arch": "sm90a", "dtype": "bf16", "head_dim": 128,
                                "mask": "document"},
                               {"fa_version": 2, "direction": ["fwd", "bwd"], "arch": "sm80",
                                "dtype": "bf16", "head_dim": 64, "mask": "document"}]}))
    return spec_file


def test_a_custom_mask_is_compiled_in_by_name(tmp_path):
    specs = load_spec_file(write_mask_spec(tmp_path)).specs
    assert sorted(s.lookup_key for s in specs) == ["bwd/bf16/hd64/document", "fwd/bf16/hd128/document",
                                                    "fwd/bf16/hd64/document"]
    for s in specs:
        assert s.mask == "custom" and s.custom_mask.source == DOCUMENT_HEADER
        assert "_document_" in s.name and s.mask_type == "fagen::algo::CustomMask<DocumentMask>"
        assert {c.name: c.c_value for c in s.constexprs()}["kMask"] == "fagen::algo::MaskKind::kCustom"
    # no short-sequence kernels for a custom mask; FA3 hd64's three-consumer tile is not its row
    assert all(s.max_seqlen_k is None for s in specs)


def test_a_custom_mask_kernel_follows_its_header(tmp_path):
    first = {s.lookup_key: s.name for s in load_spec_file(write_mask_spec(tmp_path)).specs}
    second = {s.lookup_key: s.name for s in load_spec_file(write_mask_spec(tmp_path, DOCUMENT_HEADER + "//\n")).specs}
    assert first.keys() == second.keys() and not set(first.values()) & set(second.values())


@pytest.mark.parametrize("entry, words", [
    ({"fa_version": 3, "direction": "bwd", "arch": "sm90a", "dtype": "bf16", "head_dim": 128, "mask": "document"},
     "custom masks: the FA2 backward takes them"),
    ({"fa_version": 1, "arch": "sm80", "dtype": "bf16", "head_dim": 128, "mask": "document"},
     "mask=custom: fa_version=1 fwd has the full, causal masks only"),
])
def test_algorithms_without_custom_masks_refuse_them(tmp_path, entry, words):
    with pytest.raises(SpecError, match=words):
        load_spec_file(write_mask_spec(tmp_path, kernels=[entry]))


@pytest.mark.parametrize("name, words", [("Document", "lower-case letters"), ("causal", "taken by a built-in"),
                                         ("sinks", "taken by a built-in"), ("2d", "starting with a letter")])
def test_custom_mask_names_are_checked(tmp_path, name, words):
    (tmp_path / "m.cuh").write_text(DOCUMENT_HEADER)
    with pytest.raises(SpecError, match=words):
        expand({"bundle": "b", "masks": {name: {"header": "m.cuh", "type": "M"}},
                "kernels": [{**BASE, "mask": name}]}, tmp_path)


def test_a_custom_mask_needs_its_header_and_its_declaration(tmp_path):
    with pytest.raises(SpecError, match=r"masks.document.header: cannot read"):
        expand({"bundle": "b", "masks": {"document": {"header": "absent.cuh", "type": "M"}},
                "kernels": [{**BASE, "mask": "document"}]}, tmp_path)
    assert "custom_mask come together" in error_text(mask="custom")
