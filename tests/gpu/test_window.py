"""Sliding windows (flash-attn's window_size, the local kernels of algo/mask.cuh) on the GPU:
forward and backward against the fp64 reference under attention_reference's rule, for windows
of 0, 1, 127-129 and 4096 keys, left only, right only, both, with and without causal,
seqlen_q != seqlen_k both ways, windows wider than the sequence, GQA, odd sizes and large
scores; the deterministic mode bitwise. That the time follows the window is bench.attention's
to measure (--window)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attention_reference import forward_failures, gradient_failures  # noqa: E402
from test_fa2_fwd import poison_allocator, require_kernel  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (window_size, causal)
WINDOWS = (
    ((0, 0), False), ((1, 0), False), ((0, 1), False), ((127, 0), True), ((128, -1), True),
    ((129, 129), False), ((4096, 0), False), ((64, -1), False), ((-1, 64), False), ((200, 3), False),
    ((3, 200), True), ((5000, 5000), False),
)
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SIZES = ((1, 1, 1, 1, 1), (2, 300, 300, 4, 2), (1, 77, 1000, 3, 1), (2, 1000, 77, 2, 2), (1, 1500, 1500, 2, 2))


def run_case(bundle, size, window, causal, head_dim, dtype, magnitude=1.0, scale=None, deterministic=False):
    """fagen's out, lse and gradients for one call (inputs seeded by the case), poisoned first."""
    require_kernel(bundle, dtype, head_dim, "local", "fwd")
    require_kernel(bundle, dtype, head_dim, "local", "bwd")
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = size
    torch.manual_seed(seqlen_q * 31 + seqlen_k + 7 * window[0] + window[1] + head_dim)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda") * magnitude
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda") * magnitude
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda")
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    poison_allocator((q.shape, dtype), ((batch, heads_q, seqlen_q), torch.float32))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, softmax_scale=scale,
                               deterministic=deterministic, return_lse=True, bundle=bundle)
    poison_allocator(*((t.shape, dtype) for t in (q, k, v)))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    return q, k, v, dout, out, lse, grads


def check(bundle, size, window, causal, head_dim=128, dtype=torch.bfloat16, **kwargs):
    q, k, v, dout, out, lse, grads = run_case(bundle, size, window, causal, head_dim, dtype, **kwargs)
    scale = kwargs.get("scale")
    args = (q.detach(), k.detach(), v.detach())
    failures = forward_failures(out.detach(), lse, *args, causal, scale, window)
    failures += gradient_failures(list(grads), *args, dout, causal, scale, window, out.detach())
    assert not failures, f"window {window} causal={causal} size {size}: " + "; ".join(failures)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window, causal", WINDOWS, ids=lambda w: str(w))
def test_window_matches_reference(bundle, window, causal, size):
    check(bundle, size, window, causal)


@pytest.mark.parametrize("head_dim", (64, 96, 128, 192, 256))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_window_every_head_dim(bundle, head_dim, dtype):
    check(bundle, (2, 333, 517, 4, 2), (100, 20), False, head_dim, dtype)
    check(bundle, (1, 517, 333, 2, 1), (40, 0), True, head_dim, dtype)


@pytest.mark.parametrize("magnitude, scale", ((4.0, None), (8.0, None), (1.0, 1.0)))
def test_window_large_scores(bundle, magnitude, scale):
    check(bundle, (2, 300, 500, 2, 2), (90, 10), False, magnitude=magnitude, scale=scale)


@pytest.mark.parametrize("window, causal", (((100, 0), True), ((129, 17), False)))
def test_window_deterministic_is_bitwise(bundle, window, causal):
    size = (2, 1000, 1200, 4, 2)
    first = run_case(bundle, size, window, causal, 128, torch.bfloat16, deterministic=True)[-1]
    second = run_case(bundle, size, window, causal, 128, torch.bfloat16, deterministic=True)[-1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    check(bundle, size, window, causal, deterministic=True)
