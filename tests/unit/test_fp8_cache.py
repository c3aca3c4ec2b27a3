"""An FP8 (e4m3) KV cache under fp16 / bf16 queries without a GPU: the key's dtype pair, the
split-KV model's kv_dtype (its shared memory, tuning rows and refusals), and the runtime call's
kernel, strides, descales and refusals through the fake driver."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fagen import abi, contract
from fagen.model import KernelSpec
from fagen.runtime import AttentionError, Descales, Problem, Tensor, load
from fagen.runtime.kvcache import KvCache, NewKeys, prepare_kvcache

from test_runtime_call import fake  # noqa: F401 (the fixture)
from test_runtime_cpu import kernel_entry, write_bundle  # noqa: E402

PAGED = dict(fa_version=2, arch="sm90", dtype="bf16", head_dim=128, layout="paged", mask="local", tile="auto")
KEY = "fwd/bf16-e4m3/hd128/local/paged"


def test_the_key_spells_the_cache_element_after_a_dash():
    assert contract.kernel_key("fwd", "bf16", 128, "local", layout="paged", kv_dtype="e4m3") == KEY
    assert contract.kernel_key("fwd", "bf16", 128, "local", layout="paged", kv_dtype="bf16") == \
        "fwd/bf16/hd128/local/paged"
    key = contract.KernelKey.parse(KEY)
    assert (key.dtype, key.kv_dtype, key.layout) == ("bf16", "e4m3", "paged") and str(key) == KEY
    assert contract.KernelKey.parse("fwd/bf16-bf16/hd128/local/paged") is None  # spelled once
    assert contract.KernelKey.parse("fwd/bf16/hd128/local/paged").kv_dtype is None
    assert contract.parse_dtypes("fp16-e4m3") == ("fp16", "e4m3") and contract.parse_dtypes("bf16") == ("bf16", "bf16")


def test_an_e4m3_cache_kernel_halves_its_rows_and_keeps_q_16_bit():
    wide = KernelSpec.model_validate(PAGED)
    narrow = KernelSpec.model_validate({**PAGED, "kv_dtype": "e4m3"})
    assert narrow.lookup_key == KEY and "_bf16_e4m3_" in narrow.name
    g, w = narrow.geometry, wide.geometry
    assert (g.q_row_pitch_bytes, g.row_pitch_bytes, g.v_row_pitch_bytes) == (272, 144, 144)
    assert (w.q_row_pitch_bytes, w.row_pitch_bytes) == (272, 272)
    # Its tuning row takes 32-key steps of 1-byte rows; Q's rows are followed by the warps' maxima.
    assert (narrow.tile.block_n, narrow.tile.warps, narrow.tile.stages) == (32, 4, 3)
    assert g.smem_warp_stage_bytes == 32 * (144 + 144) and g.smem_q_bytes == 16 * 272 + 16
    constexprs = {c.name: c.value for c in narrow.constexprs()}
    assert constexprs["kQRowPitchBytes"] == 272 and constexprs["kRowPitchBytes"] == 144
    assert constexprs["kLookupRows"] == contract.PAGE_SIZE_MULTIPLE == 16
    # The same dtype spelled as kv_dtype is no e4m3 cache: the kernel and its name are unchanged.
    assert KernelSpec.model_validate({**PAGED, "kv_dtype": "bf16"}).name == wide.name


@pytest.mark.parametrize("fields, match", [
    (dict(fa_version=3, arch="sm90a", dtype="bf16", head_dim=128, mask="causal", kv_dtype="e4m3"),
     "kv_dtype=e4m3: fa_version=3 fwd reads k and v of dtype's element"),
    ({**PAGED, "kv_dtype": "fp16"}, "reads k and v of dtype's or e4m3 element"),
    ({**PAGED, "head_dim": 80, "kv_dtype": "e4m3"}, "multiples of 32"),
    ({**PAGED, "kv_dtype": "int8"}, "kv_dtype"),
])
def test_specs_the_cache_kernels_cannot_build_are_refused(fields, match):
    with pytest.raises(ValidationError, match=match):
        KernelSpec.model_validate({"tile": "auto", **fields})


@pytest.fixture
def fp8_bundle(tmp_path):
    entries = []
    for key, kv_dtype in ((KEY, "e4m3"), ("fwd/bf16/hd128/local/paged", "bf16")):
        entry = kernel_entry("sm90", f"fwd/bf16_{kv_dtype}/hd128/local")
        entry.update(key=key, launch={"threads": 128, "block_m": 16, "block_n": 16, "dynamic_smem": 96512,
                                      "grid": "splits", "min_split_keys": 256})
        entries.append(entry)
    return load(write_bundle(tmp_path / "b", entries))


PROBLEM = Problem("bf16", True, 4, 1, 1024, 32, 8, 128, layout="paged", kv_dtype="e4m3")
CACHE = KvCache(seqused_k=0x800000, block_table=0x900000, block_table_batch_stride=16, page_size=64, pages=64)
Q = Tensor.contiguous(0x10000, 1, 32, 128)
OUT = Tensor.contiguous(0x600000, 1, 32, 128)
K8 = Tensor(0x200000, 64 * 8 * 128, 8 * 128, 128)  # e4m3 pages: strides in bytes
V8 = Tensor(0x400000, 64 * 8 * 128, 8 * 128, 128)
DESCALES = Descales(k=0x700000, v=0x700100, k_batch_stride=8, k_head_stride=1)


def test_an_fp8_cache_call_takes_its_kernel_and_descales(fp8_bundle, fake):  # noqa: F811
    prepared = prepare_kvcache(fp8_bundle, PROBLEM, Q, K8, V8, OUT, CACHE, descales=DESCALES)
    assert prepared.kernel.entry.key == KEY
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.k_descale, p.v_descale, p.q_descale) == (0x700000, 0x700100, None)
    assert (p.k_descale_batch_stride, p.k_descale_head_stride, p.v_descale_batch_stride) == (8, 1, 0)
    plain = prepare_kvcache(fp8_bundle, Problem("bf16", True, 4, 1, 1024, 32, 8, 128, layout="paged"),
                            Q, Tensor(0x200000, 64 * 8 * 128, 8 * 128, 128), V8, OUT, CACHE)
    assert plain.kernel.entry.key == "fwd/bf16/hd128/local/paged"


def test_only_a_kv_cache_has_another_element():
    from fagen.runtime.call import check_problem

    with pytest.raises(AttentionError, match="is a KV cache's .* not the dense layout's"):
        check_problem(Problem("bf16", True, 4, 1, 1024, 32, 8, 128, kv_dtype="e4m3"))


@pytest.mark.parametrize("problem, tensors, descales, new_keys, match", [
    (PROBLEM, (Q, Tensor(0x200000, 64 * 8 * 128, 8 * 128 + 8, 128), V8, OUT), None, None,
     "multiples of 16 elements"),  # an e4m3 row's 16 bytes are 16 elements
    (Problem("bf16", True, 4, 1, 1024, 32, 8, 128, layout="paged"), (Q, K8, V8, OUT), DESCALES, None,
     "for e4m3 problems only"),
    (Problem("e4m3", True, 4, 1, 1024, 32, 8, 128, layout="paged", kv_dtype="e4m3"), (Q, K8, V8, OUT), None, None,
     "e4m3 kernels take the dense layout"),
    (Problem("bf16", True, 4, 1, 1024, 32, 8, 128, layout="paged", kv_dtype="fp16"), (Q, K8, V8, OUT), None, None,
     "kv_dtype 'fp16'"),
    (PROBLEM, (Q, K8, V8, OUT), None, NewKeys(Tensor(0xC00000, 1024, 1024, 128), Tensor(0xD00000, 8, 8, 128), 1),
     "v_new strides .* multiples of 16"),
])
def test_fp8_cache_calls_the_kernels_cannot_run_are_refused(fp8_bundle, fake, problem, tensors, descales,  # noqa: F811
                                                            new_keys, match):
    with pytest.raises(AttentionError, match=match):
        prepare_kvcache(fp8_bundle, problem, *tensors, CACHE, descales=descales, new_keys=new_keys)
