"""The e4m3 (FP8) forward through fagen.runtime.call without a GPU: one-byte TMA maps in
128-column boxes, the descales in the parameters, a bf16 output's stride rule, the refusals;
and fp16/bf16 calls unchanged by it."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from fagen import abi, contract
from fagen.runtime import AttentionError, Descales, Problem, Tensor, load, prepare
from fagen.runtime import call

from test_runtime_call import fake  # noqa: F401 (the fixture)
from test_runtime_cpu import kernel_entry, write_bundle  # noqa: E402

E4M3_KEY = "fwd/e4m3/hd128/causal"
BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV = 2, 300, 500, 8, 2
PROBLEM = Problem("e4m3", True, BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, 128)
Q = Tensor.contiguous(0x10000, SEQLEN_Q, HEADS_Q, 128)
K = Tensor.contiguous(0x20000, SEQLEN_K, HEADS_KV, 128)
V = Tensor.contiguous(0x30000, SEQLEN_K, HEADS_KV, 128)
OUT = Tensor.contiguous(0x40000, SEQLEN_Q, HEADS_Q, 128)  # bf16
# fp32 arrays: q's and k's of (batch, nheads_kv), contiguous; v's one value.
DESCALES = Descales(q=0x50000, k=0x50100, v=0x50200, q_batch_stride=HEADS_KV, q_head_stride=1,
                    k_batch_stride=HEADS_KV, k_head_stride=1)


def _fa3_entry(key: str) -> dict:
    entry = kernel_entry("sm90a", key, fa_version=3)
    entry["launch"] = {**entry["launch"], "threads": 384, "grid": "persistent", "tma_q_rows": 128,
                       "tma_kv_rows": 128}
    return entry


@pytest.fixture
def bundle(tmp_path):
    return load(write_bundle(tmp_path / "b", [_fa3_entry(E4M3_KEY), _fa3_entry("fwd/bf16/hd128/causal"),
                                              kernel_entry("sm90", "fwd/fp16/hd128/causal")]))


def test_an_e4m3_call_maps_bytes_in_128_column_boxes(bundle, fake):  # noqa: F811
    prepared = prepare(bundle, PROBLEM, Q, K, V, OUT, softmax_scale=0.125, descales=DESCALES)
    assert prepared.kernel.entry.key == E4M3_KEY
    keys = contract.vt_keys(SEQLEN_K)
    assert keys == 512 and prepared.workspace_bytes == BATCH * HEADS_KV * 128 * keys
    for workspace in (0, 0x60008):  # none; not 16-byte aligned (V^T's TMA map needs it)
        with pytest.raises(AttentionError, match=f"needs a workspace of {prepared.workspace_bytes} bytes, 16-byte"):
            prepared.launch(0x40000, 0, 0, workspace=workspace)
    assert fake.launches == []
    second_parameters = []
    real = fake.cuLaunchKernelEx

    def launch(config, kernel, params, extra):
        second = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[1]
        second_parameters.append((ctypes.c_void_p.from_address(second).value, ctypes.string_at(second, 3 * 128)))
        return real(config, kernel, params, extra)

    fake.cuLaunchKernelEx = launch
    prepared.launch(0x40000, 0, 0, workspace=0x60000)
    # One-byte elements: byte strides are the element strides; a box row is 128 of them (128
    # bytes, the swizzle row), by the launch's 128 rows. V's map is over the V^T its companion
    # wrote into the workspace: (vt_keys, head_dim_v, heads_kv, batch), boxes of 128 keys by the
    # head dim.
    assert fake.maps == [
        ("e4m3", 0x10000, (128, SEQLEN_Q, HEADS_Q, BATCH), (HEADS_Q * 128, 128, SEQLEN_Q * HEADS_Q * 128),
         (128, 128, 1, 1)),
        ("e4m3", 0x20000, (128, SEQLEN_K, HEADS_KV, BATCH), (HEADS_KV * 128, 128, SEQLEN_K * HEADS_KV * 128),
         (128, 128, 1, 1)),
        ("e4m3", 0x60000, (keys, 128, HEADS_KV, BATCH), (keys, 128 * keys, HEADS_KV * 128 * keys),
         (128, 128, 1, 1)),
    ]
    assert contract.tma_box_columns("e4m3") == 128 and contract.DTYPE_BYTES["e4m3"] == 1
    # The companion first, on the same stream, with the workspace as its second parameter; then
    # the forward with the maps.
    companion, forward = fake.launches
    assert companion["name"].endswith(contract.E4M3_VT_SUFFIX) and forward["name"] == prepared.kernel.entry.name
    assert companion["grid"] == contract.vt_grid(SEQLEN_K, HEADS_KV, BATCH) == (4, HEADS_KV, BATCH)
    assert companion["block"] == (contract.vt_threads(128), 1, 1) == (64, 1, 1) and companion["smem"] == 0
    assert second_parameters[0][0] == 0x60000  # the companion's V^T
    assert second_parameters[1][1] == bytes([1]) * 128 + bytes([2]) * 128 + bytes([3]) * 128  # the forward's maps


def test_the_descales_reach_the_parameters(bundle, fake):  # noqa: F811
    prepared = prepare(bundle, PROBLEM, Q, K, V, OUT, softmax_scale=0.125, descales=DESCALES)
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.q_descale, p.k_descale, p.v_descale) == (0x50000, 0x50100, 0x50200)
    assert (p.q_descale_batch_stride, p.q_descale_head_stride) == (HEADS_KV, 1)  # (batch, nheads_kv)
    assert (p.k_descale_batch_stride, p.k_descale_head_stride) == (HEADS_KV, 1)
    assert (p.v_descale_batch_stride, p.v_descale_head_stride) == (0, 0)  # one value
    # The softmax scale stays the caller's: the kernel folds the descales in itself.
    assert abs(p.scale_log2 - 0.125 * contract.LOG2_E) < 1e-7
    # Element strides of q, k, v; the output's in its bf16 elements.
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (SEQLEN_Q * HEADS_Q * 128, HEADS_Q * 128, 128)
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == OUT.strides
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (BATCH, HEADS_Q, HEADS_KV, SEQLEN_Q, SEQLEN_K)


def test_without_descales_every_one_is_one(bundle, fake):  # noqa: F811
    for descales in (None, Descales()):
        p = abi.FwdParams.from_buffer_copy(prepare(bundle, PROBLEM, Q, K, V, OUT, descales=descales).params)
        assert (p.q_descale, p.k_descale, p.v_descale) == (None, None, None)
        assert [getattr(p, f"{t}_descale_{d}_stride") for t in "qkv" for d in ("batch", "head")] == [0] * 6


def test_attention_launches_with_the_descales(bundle, fake):  # noqa: F811
    call.attention(bundle, PROBLEM, Q, K, V, OUT, lse=0x60000, stream=0xABC, descales=DESCALES, workspace=0x70000)
    companion, launch = fake.launches  # V^T into the workspace, then the forward
    assert companion["params"].v == launch["params"].v == 0x30000
    params = launch["params"]
    assert (params.o, params.lse, params.q_descale, params.v_descale) == (0x40000, 0x60000, 0x50000, 0x50200)


def test_strides_follow_each_tensors_element(bundle, fake):  # noqa: F811
    # q, k, v: 16 one-byte elements (16 bytes); 8 elements are half a vector.
    half = Tensor(Q.data, Q.batch_stride, Q.row_stride + 8, Q.head_stride)
    with pytest.raises(AttentionError, match=r"q strides \(307200, 1032, 128\) must be multiples of 16 elements"):
        prepare(bundle, PROBLEM, half, K, V, OUT)
    # The output is bf16: 8 elements are 16 bytes.
    padded_out = Tensor(OUT.data, SEQLEN_Q * (HEADS_Q * 128 + 8), HEADS_Q * 128 + 8, 128)
    assert abi.FwdParams.from_buffer_copy(prepare(bundle, PROBLEM, Q, K, V, padded_out).params).o_row_stride == \
        HEADS_Q * 128 + 8
    with pytest.raises(AttentionError, match=r"out strides \(.*\) must be multiples of 8 elements"):
        prepare(bundle, PROBLEM, Q, K, V, Tensor(OUT.data, OUT.batch_stride, OUT.row_stride + 4, 128))
    with pytest.raises(AttentionError, match=r"k strides .* non-zero \(TMA kernel\)"):
        prepare(bundle, PROBLEM, Q, Tensor(K.data, 0, K.row_stride, K.head_stride), V, OUT)


@pytest.mark.parametrize("problem, descales, match", [
    (dataclasses.replace(PROBLEM, dtype="bf16"), DESCALES, "descales: for e4m3 problems only; a bf16 problem"),
    (PROBLEM, Descales(q=0x50000, k=0x50102), "descales.k=0x50102: a 4-byte aligned fp32 device array"),
    (PROBLEM, Descales(v=0x50200, v_head_stride=-1), r"descales.v_head_stride=-1: must be >= 0"),
    (PROBLEM, Descales(q_batch_stride=-2), r"descales.q_batch_stride=-2: must be >= 0"),
    (dataclasses.replace(PROBLEM, score=contract.Score(softcap=30.0)), None, "take no score modifier \\(softcap"),
    (dataclasses.replace(PROBLEM, score=contract.Score(sinks=True)), None, "take no score modifier \\(sinks"),
    (dataclasses.replace(PROBLEM, causal=False, mask_mod="document"), None, "built-in masks only"),
    (dataclasses.replace(PROBLEM, layout="varlen"), None, "take the dense layout, not 'varlen'"),
    (dataclasses.replace(PROBLEM, layout="paged"), None, "take the dense layout, not 'paged'"),
])
def test_calls_the_e4m3_kernels_cannot_run_are_refused(bundle, fake, problem, descales, match):  # noqa: F811
    with pytest.raises(AttentionError, match=match):
        prepare(bundle, problem, Q, K, V, OUT, descales=descales)
    assert fake.launches == []


def test_an_empty_call_checks_its_descales_too(bundle, fake):  # noqa: F811
    with pytest.raises(AttentionError, match="for e4m3 problems only"):
        call.attention(bundle, dataclasses.replace(PROBLEM, dtype="fp16", batch=0), Q, K, V, OUT, descales=DESCALES)


def test_there_is_no_e4m3_backward(bundle, fake):  # noqa: F811
    tensors = call.BackwardTensors(q=Q, k=K, v=V, out=OUT, dout=OUT, dq=Q, dk=K, dv=V, lse=0x60000)
    with pytest.raises(AttentionError, match="no e4m3 backward"):
        call.attention_backward(bundle, PROBLEM, tensors, workspace=0x70000)


# ---- fp16 / bf16: what they launched with before e4m3, byte for byte ----

def _params_of_2_byte_calls(problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> abi.FwdParams:
    """FagenFwdParams as fp16/bf16 calls filled them before the descales existed (ABI 8's fields
    alone; the descale fields zero)."""
    strides = {f"{name}_{dim}_stride": stride for name, t in (("q", q), ("k", k), ("v", v), ("o", out))
               for dim, stride in zip(("batch", "row", "head"), t.strides)}
    return abi.FwdParams(q=q.data, k=k.data, v=v.data, **strides,
                         lse_batch_stride=problem.heads_q * problem.seqlen_q, lse_head_stride=problem.seqlen_q,
                         batch=problem.batch, heads_q=problem.heads_q, heads_kv=problem.heads_kv,
                         seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k,
                         scale_log2=contract.kernel_scale_log2(0.1, problem.head_dim))


@pytest.mark.parametrize("dtype, fa_version", [("bf16", 3), ("fp16", 2)])
def test_two_byte_calls_are_unchanged(bundle, fake, dtype, fa_version):  # noqa: F811
    problem = dataclasses.replace(PROBLEM, dtype=dtype)
    # Strides that are multiples of 8 elements but not of 16: 16 bytes of 2-byte elements.
    q = Tensor(Q.data, SEQLEN_Q * (HEADS_Q * 136), HEADS_Q * 136, 136)
    prepared = prepare(bundle, problem, q, K, V, OUT, softmax_scale=0.1)
    assert prepared.kernel.entry.fa_version == fa_version
    assert prepared.params == bytes(_params_of_2_byte_calls(problem, q, K, V, OUT))
    if fa_version == 3:  # TMA: 2-byte strides, 64-column boxes
        q_strides = (2 * HEADS_Q * 136, 2 * 136, 2 * SEQLEN_Q * HEADS_Q * 136)
        kv_strides = (2 * HEADS_KV * 128, 2 * 128, 2 * SEQLEN_K * HEADS_KV * 128)
        assert fake.maps == [
            ("bf16", 0x10000, (128, SEQLEN_Q, HEADS_Q, BATCH), q_strides, (64, 128, 1, 1)),
            ("bf16", 0x20000, (128, SEQLEN_K, HEADS_KV, BATCH), kv_strides, (64, 128, 1, 1)),
            ("bf16", 0x30000, (128, SEQLEN_K, HEADS_KV, BATCH), kv_strides, (64, 128, 1, 1)),
        ]
    else:
        assert fake.maps == [] and prepared.extra_params == ()
    with pytest.raises(AttentionError, match=r"q strides \(.*\) must be multiples of 8 elements"):
        prepare(bundle, problem, Tensor(Q.data, Q.batch_stride, Q.row_stride + 4, 128), K, V, OUT)


def test_the_runtime_call_imports_no_jinja_pydantic_or_nvrtc():
    import subprocess
    import sys

    code = ("import sys, fagen.runtime, fagen.runtime.e4m3; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jinja2', 'pydantic', 'nvrtc'}), "
            "[m for m in sys.modules if 'nvrtc' in m])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[] []"
