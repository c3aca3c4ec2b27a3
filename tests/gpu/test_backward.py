"""The backward on the GPU: dq, dk, dv of fagen's kernels against the fp64 reference under the
rule of attention_reference (each gradient's max error at most 3x the largest error of plain
torch's low-precision computations, plus a small atol, every value finite), gradients
poisoned with NaN before the launch, large scores, GQA/MQA, strided inputs, the deterministic
mode, memory linear in the sequence length, torch.compile and CUDA graphs of a training step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attention_reference import gradient_failures  # noqa: E402
from test_fa2_fwd import LARGE_SCORES, poison_allocator, require_kernel  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, seqlen_q, seqlen_k): seqlen 1, 17, 1000, 4097 (below), and seqlen_q != seqlen_k both
# ways (causal with seqlen_q > seqlen_k has rows that see no key: their gradients are zero).
SIZES = ((1, 1, 1), (2, 17, 17), (1, 1000, 1000), (2, 128, 300), (2, 300, 128), (1, 1, 1000))


def require_backward(bundle, dtype, head_dim, causal, score=(), head_dim_v=None):
    require_kernel(bundle, dtype, head_dim, causal, direction="bwd", score=score, head_dim_v=head_dim_v)


def leaves(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v)]


def fagen_grads(q, k, v, dout, **kwargs):
    for t in (q, k, v):
        t.grad = None
    out = flash_attn_func(q, k, v, **kwargs)
    poison_allocator(*((t.shape, t.dtype) for t in (q, k, v)))
    out.backward(dout)
    torch.cuda.synchronize()
    return [t.grad for t in (q, k, v)]


def assert_grads_close(q, k, v, dout, causal, scale=None, **kwargs):
    got = fagen_grads(q, k, v, dout, causal=causal, softmax_scale=scale, **kwargs)
    assert all(g is not None for g in got), "a gradient was not computed"
    failures = gradient_failures(got, q, k, v, dout, causal, scale)
    assert not failures, "; ".join(failures)


def check(bundle, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal, magnitude=1.0, **kwargs):
    """One forward + backward against the reference; `magnitude` multiplies q and k."""
    require_backward(bundle, dtype, head_dim, causal)
    torch.manual_seed(seqlen_q * 7919 + seqlen_k * 31 + head_dim + heads_kv)
    q, k, v = leaves(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
    with torch.no_grad():
        q.mul_(magnitude)
        k.mul_(magnitude)
    dout = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    assert_grads_close(q, k, v, dout, causal, **kwargs)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gradients_match_reference(bundle, head_dim, dtype, causal, size):
    check(bundle, *size, 3, 3, head_dim, dtype, causal)


# Scores far from unit size (test_fa2_fwd.LARGE_SCORES): few keys, so that one key dominates each
# row and the LSE lies far from 0 (where zero-filled keys once overflowed to inf in the FA3
# backward), causal rows that see 1-3 keys, one past a tile, many keys.
LARGE_SCORE_SIZES = ((2, 300, 1), (2, 300, 3), (1, 77, 5), (2, 129, 129), (1, 700, 700))


@pytest.mark.parametrize("size", LARGE_SCORE_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scores", LARGE_SCORES, ids=("x4", "x8", "x4-scale1"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_large_scores(bundle, head_dim, dtype, causal, scores, size):
    magnitude, scale = scores
    check(bundle, *size, 4, 2, head_dim, dtype, causal, magnitude=magnitude, scale=scale)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_long_sequence(bundle, head_dim, causal):
    check(bundle, 1, 4097, 4097, 2, 2, head_dim, torch.bfloat16, causal)


@pytest.mark.parametrize("heads", ((8, 1), (8, 4)), ids=("mqa8to1", "gqa2to1"))
@pytest.mark.parametrize("size", ((2, 300, 300), (2, 128, 300), (2, 300, 128)), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_grouped_query_attention(bundle, head_dim, causal, size, heads):
    # dk, dv summed over the query heads each K/V head serves, without repeating K/V.
    check(bundle, *size, *heads, head_dim, torch.bfloat16, causal)


def test_strided_inputs_and_gradient(bundle):
    require_backward(bundle, torch.bfloat16, 128, True)
    torch.manual_seed(11)
    q = torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 300, 2, 136, device="cuda", dtype=torch.bfloat16)[..., :128]
    v = torch.randn(2, 2, 300, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(2, 4, 257, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert_grads_close(q, k, v, dout, True)


def test_softmax_scale_in_the_gradients(bundle):
    check(bundle, 2, 333, 333, 2, 2, 96, torch.float16, False, scale=0.3)


def test_only_needed_gradients_are_returned(bundle):
    require_backward(bundle, torch.bfloat16, 64, False)
    q, k, v = leaves(1, 64, 64, 2, 2, 64, torch.bfloat16)
    k.requires_grad_(False)
    flash_attn_func(q, k, v).float().sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


# (seqlen_q, seqlen_k): more query blocks than key blocks, fewer, and (causal) query blocks that
# no key block adds to.
@pytest.mark.parametrize("seqlens", ((1500, 1500), (100, 1000), (1000, 300)),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_deterministic_mode_is_bitwise_reproducible(bundle, head_dim, causal, seqlens):
    require_backward(bundle, torch.bfloat16, head_dim, causal)
    torch.manual_seed(12)
    q, k, v = leaves(2, *seqlens, 8, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    runs = [[g.clone() for g in fagen_grads(q, k, v, dout, causal=causal, deterministic=True)]
            for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b), "deterministic gradients differ between runs"
    assert_grads_close(q, k, v, dout, causal, deterministic=True)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_deterministic_mode_with_more_key_blocks_than_resident_ctas(bundle, causal):
    # 20000 keys: more key blocks of one head than the GPU holds CTAs at once, so a CTA that
    # waited for one launched after it would wait forever.
    require_backward(bundle, torch.bfloat16, 64, causal)
    torch.manual_seed(15)
    q, k, v = leaves(1, 20000, 20000, 2, 1, 64, torch.bfloat16)
    dout = torch.randn_like(q)
    first, second = ([g.clone() for g in fagen_grads(q, k, v, dout, causal=causal, deterministic=True)]
                     for _ in range(2))
    atomic = fagen_grads(q, k, v, dout, causal=causal)
    for name, a, b, c in zip(("dq", "dk", "dv"), first, second, atomic):
        assert torch.equal(a, b), f"{name}: deterministic gradients differ between runs"
        # The same sums in another order: apart by the rounding of dQ's fp32 accumulation and
        # of the 16-bit result.
        scale = c.float().abs().max().item()
        assert (a.float() - c.float()).abs().max().item() <= 1e-2 * scale, name


def test_backward_memory_grows_linearly_with_seqlen(bundle):
    require_backward(bundle, torch.bfloat16, 128, True)
    peaks = {}
    for seqlen in (4096, 8192):
        q, k, v = leaves(1, seqlen, seqlen, 8, 8, 128, torch.bfloat16)
        dout = torch.randn_like(q)
        out = flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        peaks[seqlen] = torch.cuda.max_memory_allocated() - base
        del q, k, v, dout, out
    # Gradients and workspace are O(seqlen); an N x N matrix would be 4x at twice the length.
    assert peaks[8192] <= 2.2 * peaks[4096], peaks


def test_torch_compile_training_step(bundle):
    require_backward(bundle, torch.bfloat16, 128, True)
    torch.manual_seed(13)
    q, k, v = leaves(2, 300, 300, 4, 2, 128, torch.bfloat16)

    def loss_fn(q, k, v):  # deterministic: bitwise comparable with the eager run
        return flash_attn_func(q * 0.5, k, v, causal=True, deterministic=True).float().pow(2).sum()

    eager = torch.autograd.grad(loss_fn(q, k, v), (q, k, v))
    compiled = torch.compile(loss_fn, fullgraph=True)
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cuda_graph_of_a_training_step(bundle):
    require_backward(bundle, torch.bfloat16, 64, False)
    torch.manual_seed(14)
    q, k, v = leaves(2, 256, 256, 4, 4, 64, torch.bfloat16)
    dout = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        flash_attn_func(q, k, v, deterministic=True).backward(dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture: loads the kernels
    torch.cuda.current_stream().wait_stream(stream)
    expected = [t.grad.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    for t in (q, k, v):
        t.grad = None
    with torch.cuda.graph(graph):
        flash_attn_func(q, k, v, deterministic=True).backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    for t, e in zip((q, k, v), expected):
        assert torch.equal(t.grad, e)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
def test_a_row_one_key_takes_has_exactly_zero_score_gradients(bundle, head_dim, dtype):
    # Each query's own key scores ~1000 above the others (base 2): every other P is 0 in fp32,
    # O is that key's V row, and D = rowsum(dO * O) must equal the key's dP to the bit (the
    # preprocess sums D on the tensor cores as the main kernel sums dP, algo/backward_rows.cuh):
    # then dS = 0 everywhere and dQ, dK are exactly 0, as they are mathematically.
    require_backward(bundle, dtype, head_dim, False)
    torch.manual_seed(head_dim)
    heads, seqlen_k = 3, 200
    q = torch.randn(2, 1, heads, head_dim, device="cuda").to(dtype)
    k = torch.randn(2, seqlen_k, heads, head_dim, device="cuda").to(dtype)
    k[:, 77] = q[:, 0]
    v = torch.randn(2, seqlen_k, heads, head_dim, device="cuda").to(dtype)
    dout = torch.randn(2, 1, heads, head_dim, device="cuda").to(dtype)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    dq, dk, dv = fagen_grads(q, k, v, dout, softmax_scale=20.0)
    assert torch.count_nonzero(dq) == 0 and torch.count_nonzero(dk) == 0, (
        f"dq, dk: {torch.count_nonzero(dq).item()}, {torch.count_nonzero(dk).item()} nonzero entries")
    torch.testing.assert_close(dv[:, 77], dout[:, 0], atol=0, rtol=2 ** -7)
