"""merge_attention_states' fused kernel on the GPU (the merge entry point of the paged-layout
kernels): against the same formula in fp64 over the bf16/fp16 inputs, at head dims 64 ... 256
and 96 (any multiple of 8), dense and packed, strided inputs, rows that saw no key in one or both
halves, LSEs of large magnitude, under torch.compile and in a CUDA graph; and the attention over
a union of key sets from its two halves."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fagen.runtime import merge as runtime_merge  # noqa: E402
from fagen.torch import flash_attn_func, merge_attention_states  # noqa: E402
from fagen.torch.merge import _merge_tensors  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def require(bundle, dtype):
    try:
        runtime_merge.merge_kernel(bundle, dtype, torch.cuda.get_device_capability())
    except runtime_merge.KernelNotFound as exc:
        pytest.skip(str(exc))


def reference(out_a, lse_a, out_b, lse_b):
    """The merge in fp64; out (..., tokens, heads, d), lse (..., heads, tokens)."""
    la, lb = lse_a.double(), lse_b.double()
    top = torch.maximum(la, lb)
    pivot = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    wa, wb = torch.exp(la - pivot), torch.exp(lb - pivot)
    total = wa + wb
    rows = lambda w: (w / torch.where(total > 0, total, torch.ones_like(total))).transpose(-1, -2).unsqueeze(-1)
    out = out_a.double() * rows(wa) + out_b.double() * rows(wb)
    return out, torch.where(total > 0, pivot + torch.log(total), torch.full_like(total, -math.inf))


def inputs(shape, dtype, seed, magnitude=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    *lead, tokens, heads, dim = shape
    out_a, out_b = (torch.randn(*shape, device="cuda", generator=gen).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(*lead, heads, tokens, device="cuda", generator=gen) * magnitude for _ in range(2))
    lse_b.view(-1)[::7] = -math.inf  # rows whose second half saw no key
    lse_a.view(-1)[::11] = -math.inf
    return out_a, lse_a, out_b, lse_b


def check(got, lse, want, want_lse, dtype):
    """Within one rounding of the output type (2x torch's own rounding of the fp64 result)."""
    rounding = (want.to(dtype).double() - want).abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= 2 * rounding + 1e-6, f"max error {error:.3g}, rounding {rounding:.3g}"
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and ((lse - want_lse)[finite].abs() <= 1e-5 * (1 + want_lse[finite].abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("shape", [(3, 37, 8), (211, 4)])  # dense (batch, seqlen, heads), packed (total, heads)
@pytest.mark.parametrize("magnitude", [1.0, 300.0])
def test_merge_against_fp64(bundle, dtype, head_dim, shape, magnitude):
    require(bundle, dtype)
    args = inputs((*shape, head_dim), DTYPES[dtype], head_dim + len(shape), magnitude)
    out, lse = merge_attention_states(*args, bundle=bundle)
    torch.cuda.synchronize()
    assert out.dtype == DTYPES[dtype] and lse.dtype == torch.float32
    check(out, lse, *reference(*args), DTYPES[dtype])
    both_empty = (args[1] == -math.inf) & (args[3] == -math.inf)
    assert (out.transpose(-2, -3)[both_empty] == 0).all() and (lse[both_empty] == -math.inf).all()


def test_strided_inputs_and_fallback_agree(bundle):
    """Non-contiguous halves (every other head of a wider tensor), and the tensor-op path."""
    require(bundle, "bf16")
    wide = [t for t in inputs((2, 50, 16, 128), torch.bfloat16, 3)]
    out_a, out_b = wide[0][:, :, ::2], wide[2][:, :, ::2]
    lse_a, lse_b = wide[1][:, ::2], wide[3][:, ::2]
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, bundle=bundle)
    check(out, lse, *reference(out_a, lse_a, out_b, lse_b), torch.bfloat16)
    plain, plain_lse = _merge_tensors(out_a, lse_a, out_b, lse_b)
    assert (out.float() - plain.float()).abs().max() <= 2 ** -7 and torch.allclose(lse, plain_lse, rtol=1e-6, atol=1e-6)


def test_compiled_and_graphed(bundle):
    require(bundle, "bf16")
    args = inputs((4, 9, 8, 64), torch.bfloat16, 4)
    want = merge_attention_states(*args, bundle=bundle)
    path = str(bundle.path)  # a path, not the Bundle: what the custom op carries
    compiled = torch.compile(lambda *a: merge_attention_states(*a, bundle=path), fullgraph=True)
    got = compiled(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = merge_attention_states(*args, bundle=bundle)
    for t in args:
        t.copy_(torch.randn_like(t.float()).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    check(captured[0], captured[1], *reference(*args), torch.bfloat16)


def test_two_halves_merge_into_the_union(bundle):
    """Attention over keys [0, 700) and [700, 1500), merged, equals attention over all of them."""
    require(bundle, "bf16")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 300, 8, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(2, 1500, 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    head, head_lse = flash_attn_func(q, k[:, :700], v[:, :700], return_lse=True, bundle=bundle)[:2]
    tail, tail_lse = flash_attn_func(q, k[:, 700:], v[:, 700:], return_lse=True, bundle=bundle)[:2]
    whole, whole_lse = flash_attn_func(q, k, v, return_lse=True, bundle=bundle)[:2]
    merged, merged_lse = merge_attention_states(head, head_lse, tail, tail_lse, bundle=bundle)
    assert (merged.float() - whole.float()).abs().max() <= 2 ** -6
    assert (merged_lse - whole_lse).abs().max() <= 1e-3
