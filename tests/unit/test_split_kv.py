"""The paged layout without a GPU: its spec model (fagen/model/fa2_split_kv.py), the contract's
layout key, band, split rule and workspace, and fagen.runtime.kvcache's checks, parameters and
launches through the fake driver."""

from __future__ import annotations

import functools

import pytest
from pydantic import ValidationError

from fagen import abi, contract
from fagen.model import KernelSpec
from fagen.runtime import AttentionError, Problem, Tensor, load
from fagen.runtime import KernelNotFound
from fagen.runtime.kvcache import KvCache, NewKeys, prepare_kvcache
from fagen.runtime.merge import States, prepare_merge

from test_runtime_call import fake  # noqa: F401 (the fixture)
from test_runtime_cpu import kernel_entry, write_bundle  # noqa: E402

PAGED = dict(fa_version=2, arch="sm90", dtype="bf16", head_dim=128, layout="paged", mask="local")


def test_a_paged_spec_is_the_split_kv_algorithm():
    spec = KernelSpec.model_validate(PAGED)
    assert type(spec).__name__ == "Fa2SplitKvSpec"
    assert spec.lookup_key == "fwd/bf16/hd128/local/paged"
    assert spec.name.startswith("fa2_fwd_sm90_bf16_hd128_local_paged_m16n16w4s3_")
    launch = spec.launch()
    assert (launch.grid, launch.block_m, launch.block_n, launch.threads) == ("splits", 16, 16, 128)
    assert launch.min_split_keys == 4 * 4 * 16
    assert '"layout":"paged"' in spec.canonical_json()
    dense = KernelSpec.model_validate({**PAGED, "layout": "dense", "mask": "causal"})
    assert "layout" not in dense.canonical_json()  # dense kernels keep their names and hashes


@pytest.mark.parametrize("fields, match", [
    ({"mask": "causal"}, "one local kernel serves all three"),
    ({"fa_version": 1, "arch": "sm80"}, "fa_version=1 layout=paged: fagen has no kernel template"),
    ({"tile": {"warps": 4, "stages": 2, "block_n": 64}}, "tile.block_n=64: must be one of"),
    ({"tile": {"warps": 3, "stages": 2}}, "tile.warps=3"),
    ({"arch": "sm86", "head_dim": 256, "tile": {"warps": 4, "stages": 4}}, "bytes of shared memory"),
])
def test_paged_specs_the_kernels_cannot_build_are_refused(fields, match):
    with pytest.raises(ValidationError, match=match):
        KernelSpec.model_validate({**PAGED, **fields})


def test_the_layout_is_a_last_key_part_and_dense_is_never_spelled():
    key = contract.kernel_key("fwd", "fp16", 64, "local", ("sinks",), layout="paged")
    assert key == "fwd/fp16/hd64/local+sinks/paged"
    assert contract.KernelKey.parse(key) == contract.KernelKey("fwd", "fp16", 64, "local", ("sinks",), None, "paged")
    assert contract.KernelKey.parse("fwd/fp16/hd64/local/dense") is None
    assert contract.KernelKey.parse("fwd/fp16/hd64/local/ragged") is None
    with pytest.raises(ValueError, match="layout='ragged'"):
        contract.kernel_key("fwd", "fp16", 64, "local", layout="ragged")


def test_the_paged_kernels_take_every_mask_as_a_band():
    def band(causal, window):
        return Problem("bf16", causal, 2, 4, 1000, 8, 2, 128, window, layout="paged").mask

    assert band(False, (-1, -1)) == contract.Mask("local", 1004, 1004)
    assert band(True, (-1, -1)) == contract.Mask("local", 1004, 0)
    assert band(True, (100, -1)) == contract.Mask("local", 100, 0)
    assert Problem("bf16", True, 2, 4, 1000, 8, 2, 128, layout="paged").key == "fwd/bf16/hd128/local/paged"


@pytest.mark.parametrize("ctas, keys, expected", [
    (8, 65536, 15), (16, 65536, 8), (32, 65536, 4), (64, 32768, 2), (128, 32768, 1), (512, 4096, 1),
    (8, 1000, 3),  # no split under 256 keys
    (8, 100, 1), (0, 100, 1),
])
def test_the_split_rule(ctas, keys, expected):
    assert contract.split_count(ctas, keys, 132, 256) == expected


def test_the_split_workspace_and_grids():
    w = contract.SplitWorkspace.of(5, 3, 2, 8, 128)
    assert (w.o_partial, w.lse_partial, w.floats) == (0, 5 * 3 * 2 * 8 * 128, 5 * 3 * 2 * 8 * 129)
    assert contract.SplitWorkspace.of(1, 3, 2, 8, 128).floats == 0
    launch = contract.Launch(threads=128, block_m=16, dynamic_smem=0, grid="splits", block_n=16)
    # 5 tokens x 4 query heads per K/V head = 20 packed rows: 2 blocks of 16, per K/V head
    assert launch.grid_dims(5, 16, 3, 132, 4096, 4, num_splits=7) == (7, 2 * 4, 3)
    assert contract.companion_grid(3, 5, 16) == (60, 1, 1)


@pytest.fixture
def paged_bundle(tmp_path):
    entry = kernel_entry("sm90", "fwd/bf16/hd128/local")
    entry.update(key="fwd/bf16/hd128/local/paged",
                 launch={"threads": 128, "block_m": 16, "block_n": 16, "dynamic_smem": 108800, "grid": "splits",
                         "min_split_keys": 256})
    return load(write_bundle(tmp_path / "b", [entry]))


def _tensors(batch=4, seqlen_q=1, heads_q=32, pages=64, page_size=64, heads_kv=8):
    q = Tensor.contiguous(0x10000, seqlen_q, heads_q, 128)
    k = Tensor(0x200000, page_size * heads_kv * 128, heads_kv * 128, 128)
    v = Tensor(0x400000, page_size * heads_kv * 128, heads_kv * 128, 128)
    out = Tensor.contiguous(0x600000, seqlen_q, heads_q, 128)
    return q, k, v, out


PAGED_PROBLEM = Problem("bf16", True, 4, 1, 1024, 32, 8, 128, layout="paged")
CACHE = KvCache(seqused_k=0x800000, block_table=0x900000, block_table_batch_stride=16, page_size=64, pages=64)


def test_a_paged_call_fills_the_serving_fields_and_launches_twice(paged_bundle, fake):  # noqa: F811
    prepared = prepare_kvcache(paged_bundle, PAGED_PROBLEM, *_tensors(), CACHE)
    # 4 rows x 8 K/V heads = 32 CTAs of 1024 keys each: 4 splits, about one CTA per SM.
    assert prepared.num_splits == 4 and prepared.grid == (4, 8, 4)
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.seqused_k, p.block_table, p.block_table_batch_stride, p.page_size, p.pages) == (
        0x800000, 0x900000, 16, 64, 64)
    assert (p.window_left, p.window_right, p.num_splits, p.cu_seqlens_q) == (1025, 0, 4, None)
    with pytest.raises(AttentionError, match="need a workspace"):
        prepared.launch(0x600000, 0, 0)
    prepared.launch(0x600000, 0xA00000, 0xABC, workspace=0xB00000)
    main, combine = fake.launches
    assert main["grid"] == (4, 8, 4) and combine["grid"] == contract.companion_grid(4, 1, 32)
    assert combine["block"] == (contract.COMPANION_THREADS, 1, 1) and combine["smem"] == 0
    assert main["params"].o_partial == 0xB00000
    assert main["params"].lse_partial == 0xB00000 + 4 * prepared.workspace.lse_partial
    one = prepare_kvcache(paged_bundle, PAGED_PROBLEM, *_tensors(), CACHE, num_splits=1)
    assert one.workspace_bytes == 0
    fake.launches.clear()
    one.launch(0x600000, 0, 0)
    assert len(fake.launches) == 1  # no combine


def test_packed_queries_take_the_lse_of_flash_attns_varlen_call(paged_bundle, fake):  # noqa: F811
    q, k, v, out = _tensors()
    packed = KvCache(block_table=0x900000, block_table_batch_stride=16, page_size=64, pages=64, cu_seqlens_q=0xC00000,
                     total_q=9)
    prepared = prepare_kvcache(paged_bundle, PAGED_PROBLEM, Tensor(q.data, 0, 32 * 128, 128), k, v,
                               Tensor(out.data, 0, 32 * 128, 128), packed, num_splits=1)
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.cu_seqlens_q, p.lse_batch_stride, p.lse_head_stride, p.q_batch_stride) == (0xC00000, 0, 9, 0)


@pytest.mark.parametrize("cache, splits, match", [
    (KvCache(block_table=0x900000, block_table_batch_stride=16, page_size=24, pages=64), 0, "page_size=24"),
    (KvCache(block_table=0x900000, block_table_batch_stride=8, page_size=64, pages=64), 0, "fewer than seqlen_k=1024"),
    (KvCache(block_table=0x900000, block_table_batch_stride=16, page_size=64, pages=0), 0, "at least one page"),
    (KvCache(seqused_k=0x800002), 0, "4-byte aligned"),
    (CACHE, 65, "num_splits=65"),
    (CACHE, True, "num_splits=True"),
])
def test_paged_calls_the_kernels_cannot_run_are_refused(paged_bundle, fake, cache, splits, match):  # noqa: F811
    with pytest.raises(AttentionError, match=match):
        prepare_kvcache(paged_bundle, PAGED_PROBLEM, *_tensors(), cache, num_splits=splits)


def test_a_dense_call_never_gets_a_paged_kernel(paged_bundle, fake):  # noqa: F811
    from fagen.runtime import KernelNotFound, prepare

    dense = Problem("bf16", True, 4, 1, 1024, 32, 8, 128)
    with pytest.raises(KernelNotFound, match="no kernel for 'fwd/bf16/hd128/causal'") as error:
        prepare(paged_bundle, dense, *_tensors())
    assert "fwd/bf16/hd128/local/paged" in str(error.value)
    with pytest.raises(AttentionError, match="has the paged layout"):
        prepare_kvcache(paged_bundle, dense, *_tensors(), CACHE)


def test_an_append_goes_first_and_the_kernel_sees_the_lengths_before_it(paged_bundle, fake):  # noqa: F811
    k_new = Tensor.contiguous(0xD00000, 3, 8, 128)
    v_new = Tensor(0xE00000, 3 * 8 * 128 * 2, 8 * 128 * 2, 128)  # strided: every other row
    prepared = prepare_kvcache(paged_bundle, PAGED_PROBLEM, *_tensors(), CACHE, num_splits=1,
                               new_keys=NewKeys(k_new, v_new, 3))
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.k_new, p.v_new, p.seqlen_new, p.seqused_k) == (0xD00000, 0xE00000, 3, 0x800000)
    assert (p.v_new_batch_stride, p.v_new_row_stride, p.v_new_head_stride) == v_new.strides
    prepared.launch(0x600000, 0, 0)
    append, main = fake.launches
    name = paged_bundle.kernels[0].name
    assert (append["name"], main["name"]) == (name + contract.SPLIT_APPEND_SUFFIX, name)
    # a warp per (row, new token, KV head): 4 x 3 x 8 rows
    assert append["grid"] == contract.companion_grid(4, 3, 8) == (24, 1, 1)
    assert append["block"] == (contract.COMPANION_THREADS, 1, 1) and append["smem"] == 0
    fake.launches.clear()
    prepared.enqueue_append(0)
    assert [launch["name"] for launch in fake.launches] == [name + contract.SPLIT_APPEND_SUFFIX]


@pytest.mark.parametrize("cache, new_keys, match", [
    (KvCache(), NewKeys(Tensor.contiguous(0xD00000, 1, 8, 128), Tensor.contiguous(0xE00000, 1, 8, 128), 1),
     "needs seqused_k"),
    (KvCache(seqused_k=0x800000, cu_seqlens_q=0xC00000), NewKeys(Tensor.contiguous(0xD00000, 1, 8, 128),
                                                                  Tensor.contiguous(0xE00000, 1, 8, 128), 1),
     "dense q"),
    (CACHE, NewKeys(Tensor.contiguous(0xD00000, 1, 8, 128), Tensor.contiguous(0xE00000, 1, 8, 128), 1025),
     "do not fit"),
    (CACHE, NewKeys(Tensor.contiguous(0xD00004, 1, 8, 128), Tensor.contiguous(0xE00000, 1, 8, 128), 1),
     "k_new must be"),
    (CACHE, NewKeys(Tensor.contiguous(0xD00000, 1, 8, 128), Tensor.contiguous(0xE00000, 1, 8, 128), -1),
     "seqlen_new=-1"),
])
def test_appends_the_kernels_cannot_take_are_refused(paged_bundle, fake, cache, new_keys, match):  # noqa: F811
    with pytest.raises(AttentionError, match=match):
        prepare_kvcache(paged_bundle, PAGED_PROBLEM, *_tensors(), cache, new_keys=new_keys)


def _states(out, lse, heads=32, seqlen=5):
    return States(Tensor.contiguous(out, seqlen, heads, 128), lse, heads * seqlen, seqlen)


def test_a_merge_runs_in_a_paged_kernels_cubin(paged_bundle, fake):  # noqa: F811
    a, b, out = _states(0x100000, 0x200000), _states(0x300000, 0x400000), _states(0x500000, 0)
    prepared = prepare_merge(paged_bundle, "bf16", 2, 5, 32, 96, a, b, out)  # any head dim of 8s
    prepared.launch(0xABC)
    (launch,) = fake.launches
    assert launch["name"] == paged_bundle.kernels[0].name + contract.SPLIT_MERGE_SUFFIX
    assert launch["grid"] == contract.companion_grid(2, 5, 32) and launch["stream"] == 0xABC
    m = launch["merge_params"]
    assert (m.out_a, m.lse_a, m.out_b, m.lse_b, m.out, m.lse) == (0x100000, 0x200000, 0x300000, 0x400000, 0x500000, None)
    assert (m.batch, m.seqlen, m.heads, m.head_dim) == (2, 5, 32, 96)
    assert (m.out_b_batch_stride, m.out_b_row_stride, m.out_b_head_stride) == (5 * 32 * 128, 32 * 128, 128)
    assert (m.lse_out_batch_stride, m.lse_out_head_stride) == (32 * 5, 5)
    with pytest.raises(KernelNotFound, match="dtype fp16 for sm_90.*layout: paged"):
        prepare_merge(paged_bundle, "fp16", 2, 5, 32, 96, a, b, out)
    with pytest.raises(AttentionError, match="multiple of 8"):
        prepare_merge(paged_bundle, "bf16", 2, 5, 32, 100, a, b, out)
    with pytest.raises(AttentionError, match="lse_b"):
        prepare_merge(paged_bundle, "bf16", 2, 5, 32, 96, a, _states(0x300000, 0), out)


@pytest.fixture
def prefill_bundle(tmp_path):
    split = kernel_entry("sm90", "fwd/bf16/hd128/local")
    split.update(key="fwd/bf16/hd128/local/paged",
                 launch={"threads": 128, "block_m": 16, "block_n": 16, "dynamic_smem": 108800, "grid": "splits",
                         "min_split_keys": 256})
    tiles = kernel_entry("sm90a", "fwd/bf16/hd128/local", fa_version=3)
    tiles.update(key="fwd/bf16/hd128/local/paged",
                 launch={"threads": 384, "block_m": 128, "dynamic_smem": 164864, "grid": "persistent",
                         "tma_q_rows": 128, "tma_kv_rows": 128})
    return load(write_bundle(tmp_path / "b", [split, tiles]))


def test_a_prefill_runs_on_the_tile_kernel_and_a_decode_on_the_split_kernels(prefill_bundle, fake):  # noqa: F811
    decode = prepare_kvcache(prefill_bundle, PAGED_PROBLEM, *_tensors(), CACHE)
    assert decode.kernel.entry.fa_version == 2 and decode.extra_params == ()
    rows = contract.PAGED_TILE_MIN_QUERIES
    prefill = Problem("bf16", True, 4, rows, 1024, 32, 8, 128, layout="paged")
    prepared = prepare_kvcache(prefill_bundle, prefill, *_tensors(seqlen_q=rows), CACHE)
    assert prepared.kernel.entry.fa_version == 3 and prepared.num_splits == 1 and prepared.workspace_bytes == 0
    # Q over (batch, seqlen_q) rows in tiles of 128; K and V over the pages, in runs of 16 keys.
    q_map, k_map, v_map = fake.maps[-3:]
    assert q_map[2] == (128, rows, 32, 4) and q_map[4] == (64, 128, 1, 1)
    # Pages of 64 keys: a 128-key tile is two pages, one box each (contract.cache_box_rows).
    assert k_map[2] == v_map[2] == (128, 64, 8, 64) and k_map[4] == (64, 64, 1, 1)
    prepared.launch(0x600000, 0xA00000, 0)
    (main,) = fake.launches
    assert main["grid"] == (min(4 * 32, 132), 1, 1)
    assert (main["params"].block_table, main["params"].page_size, main["params"].num_splits) == (0x900000, 64, 1)
    # Asked for splits, a prefill takes the split-KV kernels; the tile kernel refuses pages it cannot gather.
    assert prepare_kvcache(prefill_bundle, prefill, *_tensors(seqlen_q=rows), CACHE,
                           num_splits=2).kernel.entry.fa_version == 2
    with pytest.raises(AttentionError, match="multiple of 16"):
        prepare_kvcache(prefill_bundle, prefill, *_tensors(seqlen_q=rows, page_size=24),
                        KvCache(seqused_k=0x800000, block_table=0x900000, block_table_batch_stride=64,
                                page_size=24, pages=64))


def test_a_packed_prefill_maps_the_packed_rows(prefill_bundle, fake):  # noqa: F811
    q, k, v, out = _tensors()
    total = 700
    packed_q = Tensor(q.data, 0, 32 * 128, 128)
    cache = KvCache(seqused_k=0x800000, block_table=0x900000, block_table_batch_stride=16, page_size=64, pages=64,
                    cu_seqlens_q=0x880000, total_q=total)
    problem = Problem("bf16", True, 4, 300, 1024, 32, 8, 128, layout="paged")
    prepared = prepare_kvcache(prefill_bundle, problem, packed_q, k, v, Tensor(out.data, 0, 32 * 128, 128), cache)
    assert prepared.kernel.entry.fa_version == 3
    assert fake.maps[-3][2] == (128, total, 32, 1)
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.o_batch_stride, p.lse_batch_stride, p.lse_head_stride, p.cu_seqlens_q) == (0, 0, total, 0x880000)


@pytest.mark.parametrize("page_size, box", [(0, 128), (16, 16), (32, 32), (64, 64), (128, 128), (256, 128),
                                            (48, 16), (96, 16), (384, 128)])
def test_a_tile_loads_its_keys_in_the_largest_runs_its_pages_allow(page_size, box):
    """contract.cache_box_rows for a 128-key tile: whole tiles from a contiguous cache (0) or
    from pages holding whole tiles, whole pages where the tile holds whole pages, else 16 keys."""
    assert contract.cache_box_rows(page_size, 128) == box
    assert contract.cache_box_rows(page_size, 80) == (80 if page_size == 0 else 16)


def test_a_prefill_on_a_b200_runs_on_the_fa4_tile_kernel(tmp_path, fake, monkeypatch):  # noqa: F811
    """Compute capability 10.0: a prefill over the cache takes FA4's paged tile kernel (FA3's
    sm90a one does not run there), a decode FA2's sm100a split-KV kernel."""
    from fagen.runtime import driver

    split = kernel_entry("sm100a", "fwd/bf16/hd128/local")
    split.update(key="fwd/bf16/hd128/local/paged",
                 launch={"threads": 128, "block_m": 16, "block_n": 16, "dynamic_smem": 108800, "grid": "splits",
                         "min_split_keys": 256})
    entries = [split]
    for arch, version, smem in (("sm100a", 4, 190000), ("sm90a", 3, 164864)):
        tiles = kernel_entry(arch, "fwd/bf16/hd128/local", fa_version=version)
        tiles.update(key="fwd/bf16/hd128/local/paged",
                     launch={"threads": 384, "block_m": 128, "dynamic_smem": smem, "tma_q_rows": 128,
                             "tma_kv_rows": 128})
        entries.append(tiles)
    bundle = load(write_bundle(tmp_path / "b", entries))
    monkeypatch.setattr(driver, "compute_capability", functools.cache(lambda device=0: (10, 0)))
    assert prepare_kvcache(bundle, PAGED_PROBLEM, *_tensors(), CACHE).kernel.entry.fa_version == 2
    rows = contract.PAGED_TILE_MIN_QUERIES
    prefill = Problem("bf16", True, 4, rows, 1024, 32, 8, 128, layout="paged")
    prepared = prepare_kvcache(bundle, prefill, *_tensors(seqlen_q=rows), CACHE)
    assert (prepared.kernel.entry.fa_version, prepared.kernel.entry.arch, prepared.num_splits) == (4, "sm100a", 1)
    _, k_map, v_map = fake.maps[-3:]
    assert k_map[2] == v_map[2] == (128, 64, 8, 64) and k_map[4] == (64, 64, 1, 1)  # pages of 64: a box each
