"""The varlen layout's contract, on the CPU: its keys, its backward workspace (each sequence's dQ
accumulator rows aligned and disjoint), the runtime's checks of a varlen call and the parameter
struct it fills."""

from __future__ import annotations

import random

import pytest

from fagen import abi, contract
from fagen.model import KernelSpec
from fagen.runtime import call, driver, load

from test_runtime_call import fake  # noqa: F401 (the fixture)
from test_runtime_cpu import kernel_entry, write_bundle  # noqa: E402


def test_varlen_keys_parse_and_name():
    key = contract.kernel_key("bwd", "bf16", 128, "causal", layout="varlen")
    assert key == "bwd/bf16/hd128/causal/varlen"
    assert contract.KernelKey.parse(key).layout == "varlen"
    spec = KernelSpec.model_validate(dict(fa_version=3, direction="bwd", arch="sm90a", dtype="bf16", head_dim=128,
                                          causal=True, layout="varlen"))
    assert spec.lookup_key == key and "_varlen_" in spec.name
    assert ("kVarlen", True) in [(c.name, c.value) for c in spec.constexprs()]
    dense = KernelSpec.model_validate(dict(fa_version=3, direction="bwd", arch="sm90a", dtype="bf16", head_dim=128,
                                           causal=True))
    assert dense.tile == spec.tile and dense.name != spec.name


def test_varlen_refused_where_no_template_takes_it():
    with pytest.raises(ValueError, match="layout=varlen"):
        KernelSpec.model_validate(dict(fa_version=1, arch="sm80", dtype="bf16", head_dim=64, layout="varlen"))


@pytest.mark.parametrize("seed", range(5))
def test_accumulator_rows_of_sequences_are_aligned_and_disjoint(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 15, 16, 17, 100, 333]) for _ in range(rng.randint(1, 12))]
    begins, q = [], 0
    for n in lengths:
        begins.append(q)
        q += n
    rows = contract.varlen_accum_rows(q, len(lengths))
    spans = []
    for b, (first, n) in enumerate(zip(begins, lengths)):
        start = contract.varlen_accum_begin(first, b)
        assert start % contract.DQ_ACCUM_ROW_ALIGN == 0
        spans.append((start, start + contract.dq_accum_rows(n)))  # its rows, padded to 16
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[-1][1] <= rows


def test_varlen_workspace_sizes():
    layout = contract.BackwardWorkspace.varlen(batch=3, heads_q=4, total_q=50, max_seqlen_q=30, head_dim=64,
                                               block_m=64)
    accum = 4 * contract.varlen_accum_rows(50, 3) * 64
    assert layout.softmax_d == accum and layout.lse_log2 == accum + 4 * 50
    assert layout.floats == accum + 2 * 4 * 50 + 3 * 4 * 2 and layout.semaphores == 3 * 4 * 1


def _problem(**kwargs):
    fields = dict(dtype="bf16", causal=True, batch=2, seqlen_q=7, seqlen_k=9, heads_q=4, heads_kv=2,
                  head_dim=64, layout="varlen")
    fields.update(kwargs)
    return call.Problem(**fields)


def test_varlen_params_are_packed():
    q = call.Tensor(1 << 20, 123, 4 * 64, 64)  # a batch stride the packed layout ignores
    varlen = call.Varlen(cu_seqlens_q=4096, cu_seqlens_k=8192, total_q=12, total_k=16, seqused_k=12288)
    scale = contract.kernel_score_scale(None, 64)
    params = call.fwd_params(_problem(), q, q, q, q, scale, varlen=varlen)
    assert (params.q_batch_stride, params.o_batch_stride, params.lse_batch_stride) == (0, 0, 0)
    assert params.lse_head_stride == 12 and params.cu_seqlens_k == 8192 and params.seqused_k == 12288
    assert (params.seqlen_q, params.seqlen_k, params.batch) == (7, 9, 2)
    assert "cu_seqlens_k" in abi.field_offsets(abi.FwdParams)
    assert {"cu_seqlens_q", "cu_seqlens_k", "total_q"} <= set(abi.field_offsets(abi.BwdParams))


@pytest.mark.parametrize("varlen, message", [
    (None, "come together"),
    (call.Varlen(0, 8192, 12, 16), "cu_seqlens_q"),
    (call.Varlen(4096, 8192, 6, 16), "exceed"),
])
def test_varlen_checks(varlen, message):
    with pytest.raises(call.AttentionError, match=message):
        call._check_varlen(_problem(), varlen)


def test_varlen_call_traces_under_fake_tensors():
    """The custom op's fake implementation: shapes out of a traced call, no device touched."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fagen.torch import flash_attn_varlen_func

    with FakeTensorMode():
        q = torch.empty(10, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(12, 2, 64, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(12, 2, 32, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True, return_lse=True)
        assert out.shape == (10, 4, 32) and out.dtype == torch.bfloat16
        assert lse.shape == (4, 10) and lse.dtype == torch.float32


@pytest.mark.parametrize("lengths, items", [
    ([1024] * 16, False),            # equal lengths: the persistent walk
    ([1000, 1024, 990], False),      # nearly equal
    ([128, 1024, 300, 700], True),   # mixed: a CTA per work item
    ([1], False),
])
def test_varlen_grid_rule(lengths, items):
    assert contract.varlen_walks_items(len(lengths), max(lengths), sum(lengths)) is items



@pytest.mark.parametrize("mask", ["causal", "full"])
def test_a_walking_varlen_launch_has_a_cta_per_tile(tmp_path, fake, mask):  # noqa: F811
    """Mixed lengths on a persistent varlen kernel: a CTA per tile (under a causal mask the
    kernel's items are pairs of tiles, algo/tile_scheduler.cuh, and the second half of the grid
    exits at once: docs/performance.md, entry 133); equal lengths keep one CTA per SM."""
    items = 16 * 4 * 4
    entry = kernel_entry("sm90a", f"fwd/bf16/hd128/{mask}", fa_version=3)
    entry["key"] += "/varlen"
    entry["launch"] = {**entry["launch"], "block_m": 128, "grid": "persistent", "tma_q_rows": 128,
                       "tma_kv_rows": 128}
    bundle = load(write_bundle(tmp_path / "b", [entry]))
    tensor = call.Tensor(0x10000, 0, 4 * 128, 128)
    problem = call.Problem("bf16", mask == "causal", 4, 2048, 2048, 4, 4, 128, layout="varlen")
    mixed = call.Varlen(0x20000, 0x30000, total_q=2500, total_k=2500)
    equal = call.Varlen(0x20000, 0x30000, total_q=4 * 2048, total_k=4 * 2048)
    assert call.prepare(bundle, problem, tensor, tensor, tensor, tensor, varlen=mixed).grid == (items, 1, 1)
    sms = driver.multiprocessor_count(0)
    assert call.prepare(bundle, problem, tensor, tensor, tensor, tensor, varlen=equal).grid == (min(16 * 16, sms), 1, 1)
