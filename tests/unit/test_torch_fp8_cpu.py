"""flash_attn_func's FP8 (float8_e4m3fn) forward without a GPU: the argument checks, the custom
op and its fake implementation, the descales handed to the runtime, the bf16 output."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from fagen.runtime import Descales  # noqa: E402
from fagen.torch import adapter, flash_attn_func, kernel_key  # noqa: E402

FP8 = torch.float8_e4m3fn
BATCH, HEADS_Q, HEADS_KV = 2, 8, 2


def _qkv(seqlen_q=5, seqlen_k=7, head_dim=128, head_dim_v=None, dtype=FP8):
    q = torch.randn(BATCH, seqlen_q, HEADS_Q, head_dim).to(dtype)
    k = torch.randn(BATCH, seqlen_k, HEADS_KV, head_dim).to(dtype)
    v = torch.randn(BATCH, seqlen_k, HEADS_KV, head_dim_v or head_dim).to(dtype)
    return q, k, v


def test_the_fp8_op_and_the_existing_ops_schemas():
    assert str(torch.ops.fagen.flash_attn_fwd_fp8.default._schema) == (
        "fagen::flash_attn_fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, "
        "Tensor? v_descale, bool causal, SymInt window_left, SymInt window_right, float? softmax_scale, "
        "str? bundle) -> (Tensor, Tensor)")
    assert str(torch.ops.fagen.flash_attn_fwd.default._schema) == (
        "fagen::flash_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, Tensor? learnable_sink, "
        "bool causal, SymInt window_left, SymInt window_right, float softcap, float? softmax_scale, str? bundle, "
        "bool deterministic=False, str? mask_mod=None, Tensor? mask_args=None) -> (Tensor, Tensor)")


def test_the_key_spells_e4m3():
    assert kernel_key(FP8, 128, "causal") == "fwd/e4m3/hd128/causal"


@pytest.mark.parametrize("descale", [
    None, torch.tensor(0.5), torch.ones(1), torch.ones(1, 1), torch.ones(1, HEADS_KV), torch.ones(BATCH, 1),
    torch.ones(BATCH, HEADS_KV), torch.ones(HEADS_KV, BATCH).t(), torch.ones(1).expand(BATCH, HEADS_KV),
])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (64, 0)}, {"deterministic": True},
                                     {"softmax_scale": 0.1, "return_lse": True}])
def test_fp8_calls_get_as_far_as_the_device_check(descale, options):
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(*_qkv(), q_descale=descale, k_descale=descale, v_descale=descale, **options)


@pytest.mark.parametrize("name", ("q_descale", "k_descale", "v_descale"))
@pytest.mark.parametrize("descale, error, match", [
    (torch.ones(HEADS_KV), ValueError, r"must be a float32 tensor of shape \(batch, nheads_kv\) = \(2, 2\) or one "
                                       r"that broadcasts to it: \(\), \(1,\), \(1, 1\), \(1, nheads_kv\), "
                                       r"\(batch, 1\); got torch.float32 \(2,\)"),
    (torch.ones(BATCH, HEADS_Q), ValueError, r"got torch.float32 \(2, 8\)"),
    (torch.ones(3, 1), ValueError, r"got torch.float32 \(3, 1\)"),
    (torch.ones(1, 1, 1), ValueError, r"got torch.float32 \(1, 1, 1\)"),
    (torch.ones(BATCH, HEADS_KV, 1), ValueError, r"got torch.float32 \(2, 2, 1\)"),
    (torch.ones(BATCH, HEADS_KV, dtype=torch.float16), ValueError, "must be a float32 tensor.*got torch.float16"),
    (torch.ones((), device="meta"), ValueError, "must be on q's device cpu, got meta"),
    (0.5, TypeError, "must be a tensor or None, got float"),
])
def test_malformed_descales_are_refused(name, descale, error, match):
    with pytest.raises(error, match=f"{name} .*{match}"):
        flash_attn_func(*_qkv(), **{name: descale})


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_descales_with_fp16_or_bf16_inputs_are_refused(dtype):
    with pytest.raises(ValueError, match=r"k_descale is for float8_e4m3fn q, k, v .* leave the descales None"):
        flash_attn_func(*_qkv(dtype=dtype), k_descale=torch.ones(()))


@pytest.mark.parametrize("which", (0, 1, 2))
def test_fp8_mixed_with_another_dtype_is_refused(which):
    tensors = list(_qkv())
    tensors[which] = tensors[which].to(torch.bfloat16)
    with pytest.raises(TypeError, match="takes q, k and v all float8_e4m3fn"):
        flash_attn_func(*tensors)


@pytest.mark.parametrize("options, match", [
    ({"softcap": 30.0}, "softcap"), ({"alibi_slopes": torch.ones(HEADS_Q)}, "alibi_slopes"),
    ({"learnable_sink": torch.zeros(HEADS_Q)}, "learnable_sink"), ({"mask_mod": "document"}, "mask_mod"),
    ({"mask_args": torch.zeros(4)}, "mask_args"),
])
def test_what_the_fp8_kernels_do_not_take_is_refused(options, match):
    with pytest.raises(NotImplementedError, match=f"{match} is not supported with float8_e4m3fn inputs"):
        flash_attn_func(*_qkv(), **options)


@pytest.mark.parametrize("which", (0, 1, 2))
def test_fp8_inputs_that_require_grad_are_refused(which):
    tensors = list(_qkv())
    tensors[which].requires_grad_(True)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn inputs have no backward"):
        flash_attn_func(*tensors)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(*tensors)


def test_unusable_fp8_layouts_are_copied():
    # 16 one-byte elements are a 16-byte vector: a row stride of 8 x 136 is not, 8 x 144 is.
    padded = torch.randn(BATCH, 9, HEADS_Q, 136).to(FP8)[..., :128]
    assert adapter._kernel_strides(padded) is None
    padded_bf16 = torch.randn(BATCH, 9, HEADS_Q, 136, dtype=torch.bfloat16)[..., :128]
    assert adapter._kernel_strides(padded_bf16) == (9 * HEADS_Q * 136, HEADS_Q * 136, 136)
    ready = adapter._kernel_ready(padded)
    assert ready.is_contiguous() and torch.equal(ready.view(torch.uint8), padded.view(torch.uint8))
    aligned = torch.randn(BATCH, 9, HEADS_Q, 144).to(FP8)[..., :128]
    assert adapter._kernel_ready(aligned) is aligned


def test_fake_impl_gives_a_bf16_output_and_an_fp32_lse():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = _qkv(seqlen_q=5, seqlen_k=11, head_dim=128, head_dim_v=256)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, q_descale=torch.ones(BATCH, HEADS_KV),
                                   k_descale=torch.ones(()), v_descale=torch.ones(1))
    assert out.shape == (BATCH, 5, HEADS_Q, 256) and out.dtype == torch.bfloat16
    assert lse.shape == (BATCH, HEADS_Q, 5) and lse.dtype == torch.float32


def test_the_fake_impl_checks_the_descales():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ValueError, match="q_descale must be a float32 tensor"):
        adapter.flash_attn_fwd_fp8(*_qkv(), torch.ones(3), None, None, True, -1, -1, None, None)


def test_torch_compile_traces_one_graph_with_the_fp8_op():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=capture)
    def attention(q, k, v, descale):
        return flash_attn_func(q, k, v, causal=True, q_descale=descale, k_descale=descale, v_descale=descale) * 2

    with pytest.raises(ValueError, match="CUDA tensors"):  # traced fine; the CPU run is refused
        attention(*_qkv(), torch.ones(BATCH, HEADS_KV))
    assert len(graphs) == 1
    assert "torch.ops.fagen.flash_attn_fwd_fp8.default" in graphs[0].code


def _without_device(monkeypatch):
    """Runs the FP8 forward on CPU tensors down to the runtime: the device check, the kernel
    choice, the runtime's prepare and the launch are replaced; returns the runtime preparations'
    arguments and the launches' outputs."""
    preparations, launches = [], []

    class Entry:
        class launch:
            tma_q_rows = 128

    class Prepared:
        device = 0

    def prepare(kernels, problem, q, k, v, out, softmax_scale, device, entry, arrays, descales=None):
        preparations.append(dict(problem=problem, q=q, out=out, descales=descales))
        return Prepared()

    monkeypatch.setattr(adapter, "_prepared_launches", {})
    monkeypatch.setattr(adapter, "get_bundle", lambda bundle: object())
    monkeypatch.setattr(adapter, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(adapter.runtime_call, "select", lambda kernels, problem, device: Entry())
    monkeypatch.setattr(adapter.runtime_call, "prepare", prepare)
    monkeypatch.setattr(adapter, "_launch", lambda prepared, out, lse: launches.append((out, lse)))
    monkeypatch.setattr(adapter.driver, "primary_context", lambda device: contextlib.nullcontext())
    return preparations, launches


def test_the_descales_reach_the_runtime_in_place(monkeypatch):
    preparations, launches = _without_device(monkeypatch)
    q, k, v = _qkv()
    q_descale = torch.ones(HEADS_KV, BATCH).t()  # a (batch, nheads_kv) view, strides (1, batch)
    k_descale, v_descale = torch.ones(BATCH, HEADS_KV), torch.tensor(2.0)
    out, lse = adapter._flash_attn_fwd_fp8(q, k, v, q_descale, k_descale, v_descale, True, -1, -1, None, None)
    assert out.dtype == torch.bfloat16 and out.shape == (BATCH, 5, HEADS_Q, 128) and lse.dtype == torch.float32
    (prepared,) = preparations
    assert prepared["problem"].dtype == "e4m3" and prepared["problem"].key == "fwd/e4m3/hd128/causal"
    assert prepared["descales"] == Descales(
        q=q_descale.data_ptr(), k=k_descale.data_ptr(), v=v_descale.data_ptr(),
        q_batch_stride=1, q_head_stride=BATCH, k_batch_stride=HEADS_KV, k_head_stride=1)
    # The bf16 output's strides in its own elements.
    assert prepared["out"].strides == (5 * HEADS_Q * 128, HEADS_Q * 128, 128)
    assert launches[0][0] is out
    # A repeated call reuses the preparation; other descales are prepared anew.
    adapter._flash_attn_fwd_fp8(q, k, v, q_descale, k_descale, v_descale, True, -1, -1, None, None)
    assert len(preparations) == 1 and len(launches) == 2
    out, _ = adapter._flash_attn_fwd_fp8(q, k, v, q_descale, k_descale, None, True, -1, -1, None, None)
    assert len(preparations) == 2 and preparations[1]["descales"].v == 0 and out.dtype == torch.bfloat16


@pytest.mark.parametrize("shape, strides", [((1, 1), (0, 0)), ((1, HEADS_KV), (0, 1)), ((BATCH, 1), (1, 0))])
def test_broadcast_descales_read_their_size_one_dimensions_with_stride_0(monkeypatch, shape, strides):
    # A size-1 dimension's own stride would read past the array at batch row or K/V head 1.
    preparations, _ = _without_device(monkeypatch)
    descale = torch.ones(shape)
    adapter._flash_attn_fwd_fp8(*_qkv(), None, descale, None, True, -1, -1, None, None)
    got = preparations[0]["descales"]
    assert (got.k, got.k_batch_stride, got.k_head_stride) == (descale.data_ptr(), *strides)


def test_no_descales_and_no_keys(monkeypatch):
    preparations, launches = _without_device(monkeypatch)
    q, k, v = _qkv()
    adapter._flash_attn_fwd_fp8(q, k, v, None, None, None, False, -1, -1, None, None)
    assert preparations[0]["descales"] == Descales()
    q, k, v = _qkv(seqlen_k=0)
    out, lse = adapter._flash_attn_fwd_fp8(q, k, v, None, None, None, False, -1, -1, None, None)
    assert out.dtype == torch.bfloat16 and not out.any() and torch.isneginf(lse).all()
    assert len(preparations) == 1


def test_the_other_calls_still_refuse_fp8():
    from fagen.torch import flash_attn_varlen_func

    q = torch.randn(10, HEADS_Q, 128).to(FP8)
    offsets = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="supported: float16, bfloat16"):
        flash_attn_varlen_func(q, q, q, offsets, offsets, 10, 10)
    with pytest.raises(TypeError, match="supported: float16, bfloat16"):
        adapter._flash_attn_fwd(*_qkv(), None, None, True, -1, -1, 0.0, None, None)
