"""head_dim_v != head_dim on the GPU (DeepSeek-V3/R1's prefill: q and k of 192, v of 128): the
output takes v's head dim, dq and dk q's and k's, dv v's; forward and backward against the fp64
reference under attention_reference's rule, with every mask, seqlen_q != seqlen_k both ways (rows
that see no key), GQA, odd sizes and large scores; the deterministic mode bitwise. Skips what the
bundle under test lacks: the default bundle has bf16 causal, tests/gpu/score_variants.yaml builds
the rest (both dtypes, every mask)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attention_reference import forward_failures, gradient_failures  # noqa: E402
from test_fa2_fwd import poison_allocator, require_kernel  # noqa: E402
from test_score import MASKS, SIZE_IDS, SIZES  # noqa: E402  (the same masks and sizes as the modifiers')
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEAD_DIM, HEAD_DIM_V = 192, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_case(bundle, size, mask, dtype, magnitude=1.0, deterministic=False):
    """fagen's out, lse and (dq, dk, dv) for one call, outputs and gradients poisoned first."""
    window, causal = MASKS[mask]
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = size
    mask_kind = contract.call_mask(causal, window, seqlen_q, seqlen_k).kind
    for direction in ("fwd", "bwd"):
        require_kernel(bundle, dtype, HEAD_DIM, mask_kind, direction, head_dim_v=HEAD_DIM_V)
    torch.manual_seed(seqlen_q * 31 + seqlen_k + len(mask))
    q = torch.randn(batch, seqlen_q, heads_q, HEAD_DIM, device="cuda") * magnitude
    k = torch.randn(batch, seqlen_k, heads_kv, HEAD_DIM, device="cuda") * magnitude
    v = torch.randn(batch, seqlen_k, heads_kv, HEAD_DIM_V, device="cuda")
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(batch, seqlen_q, heads_q, HEAD_DIM_V, device="cuda", dtype=dtype)
    poison_allocator(((batch, seqlen_q, heads_q, HEAD_DIM_V), dtype), ((batch, heads_q, seqlen_q), torch.float32))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=deterministic,
                               return_lse=True, bundle=bundle)
    poison_allocator(*((t.shape, dtype) for t in (q, k, v)))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    return q, k, v, dout, out, lse, grads


def check(bundle, size, mask, dtype, **kwargs):
    q, k, v, dout, out, lse, grads = run_case(bundle, size, mask, dtype, **kwargs)
    window, causal = MASKS[mask]
    assert out.shape == (*q.shape[:3], HEAD_DIM_V)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    args = (q.detach(), k.detach(), v.detach())
    failures = forward_failures(out.detach(), lse, *args, causal, None, window)
    failures += gradient_failures(list(grads), *args, dout, causal, None, window, out.detach())
    assert not failures, f"{mask} size {size}: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("mask", MASKS)
def test_split_head_dims_match_reference(bundle, mask, size, dtype):
    check(bundle, size, mask, dtype)


@pytest.mark.parametrize("magnitude", (4.0, 8.0))
@pytest.mark.parametrize("mask", ("causal", "full"))
def test_split_head_dims_large_scores(bundle, mask, magnitude):
    check(bundle, (2, 300, 500, 2, 2), mask, torch.bfloat16, magnitude=magnitude)


def test_split_head_dims_deterministic_is_bitwise(bundle):
    size = (2, 1000, 1200, 4, 2)
    first = run_case(bundle, size, "causal", torch.bfloat16, deterministic=True)[-1]
    second = run_case(bundle, size, "causal", torch.bfloat16, deterministic=True)[-1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_missing_split_head_dims_name_their_build_line(bundle):
    """A pair of head dims the bundle lacks: the error names the key and the spec entry."""
    q = torch.randn(1, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelNotFound, match=r"(?s)fwd/bf16/hd128v64/full.*head_dim_v: 64"):
        flash_attn_func(q, q, v, bundle=bundle)
