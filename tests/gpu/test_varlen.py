"""flash_attn_varlen_func on the GPU (the varlen layout's FA3 and FA2 kernels), forward and
backward: every sequence of a packed batch is checked against the fp32 reference of its own
tokens (attention_reference's 2x / 3x rule), with mixed lengths including 0 and 1, sequences
shorter than a tile and longer than several, different query and key lengths (bottom-right
causal), MHA, GQA 3:1 and MQA 8:1, windows, outputs and gradients poisoned before the launch,
large magnitudes, the deterministic mode, a batch equal to the dense call, and vLLM's paged call.

$FAGEN_VARLEN_FA2_BUNDLE (optional): a bundle of FA2 varlen kernels for this GPU, run through the
same checks (the default bundle builds FA2's varlen kernels for sm80 only)."""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")

from attention_reference import forward_failures, gradient_failures  # noqa: E402
from test_fa2_fwd import poison_allocator  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, get_bundle  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (query lengths, key lengths): empty sequences, single tokens, shorter than a tile, several tiles.
LENGTHS = {
    "mixed": ([0, 1, 17, 130, 300, 64, 257], [5, 1, 17, 200, 300, 64, 257]),
    "no_keys": ([3, 40], [0, 40]),
    "long": ([1000, 33], [1000, 700]),
}
HEADS = {"mha": (4, 4), "gqa3": (6, 2), "mqa8": (8, 1)}


def bundles():
    found = [("default", None)]
    if os.environ.get("FAGEN_VARLEN_FA2_BUNDLE"):
        found.append(("fa2", os.environ["FAGEN_VARLEN_FA2_BUNDLE"]))
    return found


@pytest.fixture(params=bundles(), ids=lambda b: b[0])
def varlen_bundle(request, bundle):
    return bundle if request.param[1] is None else get_bundle(request.param[1])


def require(bundle, direction, dtype, head_dim, mask, layout="varlen"):
    key = contract.kernel_key(direction, dtype, head_dim, mask, layout=layout)
    try:
        return bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key}: {str(exc).splitlines()[0]}")


class Packed:
    """Random q, k, v of sequences of the given lengths, packed, with their offsets."""

    def __init__(self, q_lens, k_lens, heads, head_dim, dtype, magnitude=1.0, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        heads_q, heads_kv = heads
        self.q_lens, self.k_lens = list(q_lens), list(k_lens)
        total_q, total_k = sum(q_lens), sum(k_lens)
        self.q = (torch.randn(total_q, heads_q, head_dim, device="cuda", generator=gen) * magnitude).to(dtype)
        self.k = (torch.randn(total_k, heads_kv, head_dim, device="cuda", generator=gen) * magnitude).to(dtype)
        self.v = torch.randn(total_k, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
        self.dout = torch.randn(total_q, heads_q, head_dim, device="cuda", generator=gen).to(dtype)
        self.cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        self.cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def rows(self, t, b, keys=False):
        """Sequence b's rows of a packed tensor, as a batch of one: (1, n, heads, d)."""
        cu = self.cu_k if keys else self.cu_q
        return t[int(cu[b]):int(cu[b + 1])][None]

    def call(self, bundle, causal, window=(-1, -1), grad=False, **kwargs):
        q, k, v = (t.detach().clone().requires_grad_(grad) for t in (self.q, self.k, self.v))
        poison_allocator(((*q.shape[:2], v.shape[2]), q.dtype), ((q.shape[1], q.shape[0]), torch.float32))
        out, lse = flash_attn_varlen_func(q, k, v, self.cu_q, self.cu_k, max(self.q_lens), max(self.k_lens),
                                          causal=causal, window_size=window, return_lse=True, bundle=bundle,
                                          **kwargs)
        grads = None
        if grad:
            out.backward(self.dout)
            grads = (q.grad, k.grad, v.grad)
        torch.cuda.synchronize()
        return out.detach(), lse, grads


def check(packed, out, lse, grads, causal, window=(-1, -1)):
    failures = []
    for b in range(len(packed.q_lens)):
        if packed.q_lens[b] == 0:
            continue
        q, k, v = packed.rows(packed.q, b), packed.rows(packed.k, b, True), packed.rows(packed.v, b, True)
        o = packed.rows(out, b)
        row_lse = lse[:, int(packed.cu_q[b]):int(packed.cu_q[b + 1])][None]
        if k.shape[1] == 0:
            if not (o == 0).all() or not (row_lse == -math.inf).all():
                failures.append(f"sequence {b} (no keys): not zeros / -inf")
            continue
        failures += [f"sequence {b} ({q.shape[1]}x{k.shape[1]}): {f}"
                     for f in forward_failures(o, row_lse, q, k, v, causal, None, window)]
        if grads is not None:
            dq, dk, dv = (packed.rows(g, b, keys=i > 0) for i, g in enumerate(grads))
            failures += [f"sequence {b} ({q.shape[1]}x{k.shape[1]}) grad: {f}"
                         for f in gradient_failures((dq, dk, dv), q, k, v, packed.rows(packed.dout, b), causal,
                                                    None, window, o)]
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_varlen_forward_backward(varlen_bundle, dtype, head_dim, causal, lengths):
    mask = "causal" if causal else "full"
    require(varlen_bundle, "fwd", dtype, head_dim, mask)
    require(varlen_bundle, "bwd", dtype, head_dim, mask)
    packed = Packed(*LENGTHS[lengths], HEADS["gqa3"], head_dim, DTYPES[dtype], seed=head_dim)
    out, lse, grads = packed.call(varlen_bundle, causal, grad=True)
    check(packed, out, lse, grads, causal)


@pytest.mark.parametrize("heads", HEADS)
def test_varlen_heads_and_magnitudes(varlen_bundle, heads):
    require(varlen_bundle, "bwd", "bf16", 128, "causal")
    packed = Packed(*LENGTHS["mixed"], HEADS[heads], 128, torch.bfloat16, magnitude=4.0, seed=7)
    out, lse, grads = packed.call(varlen_bundle, True, grad=True, softmax_scale=0.25)
    failures = []
    for b in range(len(packed.q_lens)):
        if packed.q_lens[b] == 0 or packed.k_lens[b] == 0:
            continue
        q, k, v = packed.rows(packed.q, b), packed.rows(packed.k, b, True), packed.rows(packed.v, b, True)
        failures += [f"sequence {b}: {f}" for f in forward_failures(
            packed.rows(out, b), lse[:, int(packed.cu_q[b]):int(packed.cu_q[b + 1])][None], q, k, v, True, 0.25)]
        dq, dk, dv = (packed.rows(g, b, keys=i > 0) for i, g in enumerate(grads))
        failures += [f"sequence {b} grad: {f}" for f in gradient_failures(
            (dq, dk, dv), q, k, v, packed.rows(packed.dout, b), True, 0.25, out=packed.rows(out, b))]
    assert not failures, "; ".join(failures)


def test_varlen_window(varlen_bundle):
    require(varlen_bundle, "bwd", "bf16", 128, "local")
    packed = Packed(*LENGTHS["mixed"], HEADS["gqa3"], 128, torch.bfloat16, seed=3)
    out, lse, grads = packed.call(varlen_bundle, True, window=(48, 0), grad=True)
    check(packed, out, lse, grads, True, (48, 0))


def test_varlen_deterministic(varlen_bundle):
    require(varlen_bundle, "bwd", "bf16", 128, "causal")
    packed = Packed(*LENGTHS["mixed"], HEADS["gqa3"], 128, torch.bfloat16, seed=5)
    first = packed.call(varlen_bundle, True, grad=True, deterministic=True)[2]
    again = packed.call(varlen_bundle, True, grad=True, deterministic=True)[2]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_varlen_equals_dense(varlen_bundle):
    """Equal lengths packed give the dense call's output, LSE and gradients (the same kernels'
    arithmetic, so within rounding of each other)."""
    require(varlen_bundle, "bwd", "bf16", 128, "causal")
    batch, seqlen = 3, 384
    packed = Packed([seqlen] * batch, [seqlen] * batch, HEADS["gqa3"], 128, torch.bfloat16, seed=9)
    out, lse, grads = packed.call(varlen_bundle, True, grad=True)
    q, k, v = (t.detach().view(batch, seqlen, *t.shape[1:]).clone().requires_grad_() for t in
               (packed.q, packed.k, packed.v))
    dense_out, dense_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dense_out.backward(packed.dout.view(batch, seqlen, *packed.dout.shape[1:]))
    assert (out.view_as(dense_out) - dense_out).abs().max() <= 2 ** -6
    assert torch.allclose(lse.view(-1, batch, seqlen).transpose(0, 1), dense_lse, atol=1e-3)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got.view_as(want) - want).abs().max() <= 2 ** -5 * max(want.abs().max().item(), 1.0)


def test_varlen_paged_call(bundle):
    """vLLM's call shape: packed queries over a paged cache through block_table and seqused_k."""
    require(bundle, "fwd", "bf16", 128, "local", layout="paged")
    lens, new, page = [37, 300, 1], [3, 1, 2], 16
    heads_q, heads_kv, d = 8, 2, 128
    pages = sum(-(-n // page) for n in lens) + 2
    k_cache = torch.randn(pages, page, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    gen = torch.Generator(device="cuda").manual_seed(1)
    table = torch.randint(0, pages, (len(lens), 20), device="cuda", generator=gen, dtype=torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(new), heads_q, d, device="cuda", dtype=torch.bfloat16)
    seqused = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(new), 320, seqused_k=seqused,
                                 block_table=table, causal=True)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqused, block_table=table,
                                   cu_seqlens_q=cu_q, max_seqlen_q=max(new), causal=True)
    assert torch.equal(out, want)


def test_varlen_refusals(bundle):
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="entries"):
        flash_attn_varlen_func(q, q, q, cu, cu[:2], 6, 6)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, 0.1)
    with pytest.raises(ValueError, match="exceed"):
        flash_attn_varlen_func(q, q, q, cu, cu, 11, 6)


def test_merge_prefix_and_suffix(bundle):
    """A decode step over a shared prefix and each row's own keys, merged (cascade attention),
    against the step over the whole cache."""
    require(bundle, "fwd", "bf16", 128, "local", layout="paged")
    from fagen.torch import merge_attention_states

    gen = torch.Generator(device="cuda").manual_seed(11)
    batch, prefix, total, heads_q, heads_kv, d = 3, 192, 700, 8, 2, 128
    k_cache = torch.randn(batch, total, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(batch, total, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, 1, heads_q, d, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([700, 193, 450], dtype=torch.int32, device="cuda")
    whole, whole_lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
    head, head_lse = flash_attn_with_kvcache(q, k_cache[:, :prefix], v_cache[:, :prefix], cache_seqlens=prefix,
                                             return_lse=True)
    tail, tail_lse = flash_attn_with_kvcache(q, k_cache[:, prefix:], v_cache[:, prefix:], cache_seqlens=lens - prefix,
                                             return_lse=True)
    merged, merged_lse = merge_attention_states(head, head_lse, tail, tail_lse)
    assert (merged.float() - whole.float()).abs().max() <= 2 ** -6
    assert (merged_lse - whole_lse).abs().max() <= 1e-3


def test_scheduler_metadata(bundle):
    """get_scheduler_metadata's split count is what flash_attn_with_kvcache then runs."""
    require(bundle, "fwd", "bf16", 128, "local", layout="paged")
    from fagen.torch import get_scheduler_metadata

    batch, capacity, heads_q, heads_kv, d = 2, 8192, 32, 8, 128
    metadata = get_scheduler_metadata(batch, 1, capacity, heads_q, heads_kv, d, bundle=bundle)
    splits = int(metadata[0])
    assert metadata.device.type == "cpu" and 1 <= splits <= contract.MAX_SPLITS
    k_cache = torch.randn(batch, capacity, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([8000, 3000], dtype=torch.int32, device="cuda")
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, scheduler_metadata=metadata)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="scheduler_metadata"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, scheduler_metadata=metadata.cuda())


def test_varlen_under_torch_compile(bundle):
    """torch.compile(fullgraph=True) of a varlen forward and backward (the custom ops) gives the
    eager call's output and gradients, bit for bit."""
    require(bundle, "bwd", "bf16", 128, "causal")
    packed = Packed(*LENGTHS["mixed"], HEADS["gqa3"], 128, torch.bfloat16, seed=13)
    max_q, max_k = max(packed.q_lens), max(packed.k_lens)

    def attend(q, k, v):
        return flash_attn_varlen_func(q, k, v, packed.cu_q, packed.cu_k, max_q, max_k, causal=True)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        q, k, v = (t.detach().clone().requires_grad_() for t in (packed.q, packed.k, packed.v))
        out = fn(q, k, v)
        out.backward(packed.dout)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_kvcache_under_torch_compile(bundle):
    """torch.compile(fullgraph=True) of a decode step with appends (the custom op
    fagen::flash_attn_kvcache after traced index writes): the eager step's output and cache."""
    require(bundle, "fwd", "bf16", 128, "local", layout="paged")
    gen = torch.Generator(device="cuda").manual_seed(17)
    batch, pages, page, heads_q, heads_kv, d = 3, 64, 16, 8, 2, 128
    table = torch.randperm(pages, device="cuda", generator=gen)[:batch * 20].view(batch, 20).to(torch.int32)
    lens = torch.tensor([5, 200, 17], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads_q, d, device="cuda", generator=gen).to(torch.bfloat16)
    k_new = torch.randn(batch, 1, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)
    v_new = torch.randn_like(k_new)
    start = torch.randn(pages, page, heads_kv, d, device="cuda", generator=gen).to(torch.bfloat16)

    def step(k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
                                       causal=True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        k_cache, v_cache = start.clone(), start.clone()
        results.append((fn(k_cache, v_cache), k_cache, v_cache))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
