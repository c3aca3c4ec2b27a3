"""The forward on the GPU against the fp64 reference (the rule of attention_reference).

An output passes when its max error is at most 2x the largest error of plain torch's
low-precision computations, plus a small atol. Outputs are poisoned with NaN through the caching
allocator, so an element the kernel never writes fails.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attention_reference import NO_MODS, Mods, forward_failures, geometric_alibi_slopes  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime.loader import runs_on  # noqa: E402
from fagen.torch import KernelNotFound, flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16)
DTYPE_BY_NAME = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (batch, seqlen_q, seqlen_k): seqlen 1, odd sizes, seqlen_q != seqlen_k in both directions
# (causal with seqlen_q > seqlen_k has rows that see no key), one query against many keys.
SIZES = ((1, 1, 1), (2, 17, 17), (1, 1000, 1000), (2, 128, 300), (2, 300, 128), (1, 1, 1000))
LONG_SIZE = (1, 4097, 4097)
HEADS = 3


def mask_name(causal) -> str:
    """A mask kind (contract.MASKS) from a causal flag, or the kind itself."""
    if isinstance(causal, bool):
        return "causal" if causal else "full"
    return causal


def require_kernel(bundle, dtype, head_dim, causal, direction="fwd", score=(), head_dim_v=None):
    """Skips unless the bundle has the kernel; `causal`: a bool or a mask kind; `score`: its
    score modifiers; `head_dim_v`: v's head dim where it differs."""
    key = contract.kernel_key(direction, {v: k for k, v in DTYPE_BY_NAME.items()}[dtype], head_dim,
                              mask_name(causal), score, head_dim_v)
    try:
        bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key} for this device: {str(exc).splitlines()[0]}")


def random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, head_dim_v=None):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v or head_dim, device="cuda", dtype=dtype)
    return q, k, v


def value_dim(entry) -> int:
    """v's and the output's head dim of a kernel of the bundle."""
    key = contract.KernelKey.parse(entry.key)
    return key.head_dim_v or key.head_dim


def poison_allocator(*shapes_and_dtypes):
    """Leave NaN in the free blocks that allocations of these shapes will get next.

    The caching allocator hands out the best-fitting free block, so allocating the same sizes in
    the same order right after these are freed lands on the same (NaN-filled) memory.
    """
    torch.cuda.empty_cache()
    blocks = [torch.full(shape, math.nan, dtype=dtype, device="cuda") for shape, dtype in shapes_and_dtypes]
    del blocks


def run_poisoned(q, k, v, **kwargs):
    batch, seqlen_q, heads_q, _ = q.shape
    poison_allocator(((batch, seqlen_q, heads_q, v.shape[3]), q.dtype), ((batch, heads_q, seqlen_q), torch.float32))
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kwargs)
    torch.cuda.synchronize()
    return out, lse


def assert_close_to_reference(out, lse, q, k, v, causal, scale=None, window=(-1, -1), mods=NO_MODS):
    failures = forward_failures(out, lse, q, k, v, causal, scale, window, mods)
    assert not failures, "; ".join(failures)


def check_case(bundle, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal, magnitude=1.0,
               scale=None):
    """One call against the reference; `magnitude` multiplies q and k (scores grow by its square)."""
    require_kernel(bundle, dtype, head_dim, causal)
    torch.manual_seed(seqlen_q * 7919 + seqlen_k * 31 + head_dim)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
    q, k = (t * magnitude for t in (q, k))
    out, lse = run_poisoned(q, k, v, causal=causal, softmax_scale=scale)
    assert_close_to_reference(out, lse, q, k, v, causal, scale)


def test_poisoning_reaches_the_next_allocation():
    poison_allocator(((2, 300, 3, 128), torch.bfloat16), ((2, 3, 300), torch.float32))
    out = torch.empty(2, 300, 3, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 3, 300, dtype=torch.float32, device="cuda")
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_reference(bundle, head_dim, dtype, causal, size):
    batch, seqlen_q, seqlen_k = size
    check_case(bundle, batch, seqlen_q, seqlen_k, HEADS, HEADS, head_dim, dtype, causal)


# Scores far from unit size: q and k x4 / x8 with the default scale, and softmax_scale 1.0 (about
# 11x the default at head_dim 128); few keys (one key dominates every row), one past a tile, many.
LARGE_SCORES = ((4.0, None), (8.0, None), (4.0, 1.0))
LARGE_SCORE_SIZES = ((2, 300, 1), (2, 300, 3), (1, 77, 5), (2, 129, 129), (1, 1000, 1000))


@pytest.mark.parametrize("size", LARGE_SCORE_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scores", LARGE_SCORES, ids=("x4", "x8", "x4-scale1"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_large_scores(bundle, head_dim, dtype, causal, scores, size):
    magnitude, scale = scores
    check_case(bundle, *size, 4, 2, head_dim, dtype, causal, magnitude=magnitude, scale=scale)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", (128, 256))
def test_long_sequence(bundle, head_dim, dtype, causal):
    check_case(bundle, *LONG_SIZE, 2, 2, head_dim, dtype, causal)


def entry_call(entry, batch, heads_q):
    """How a test launches `entry` directly: dtype, head_dim, causal, window (a local kernel runs
    with EVERY_KERNEL_WINDOW), the modifiers' reference form (Mods) and prepare_launch's options
    for them (softcap 30, ALiBi's geometric slopes, sinks of either sign)."""
    key = contract.KernelKey.parse(entry.key)
    window = EVERY_KERNEL_WINDOW if key.mask == "local" else (-1, -1)
    mods = Mods(
        softcap=30.0 if "softcap" in key.mods else 0.0,
        alibi=geometric_alibi_slopes(heads_q, "cuda") if "alibi" in key.mods else None,
        sink=(torch.tensor([(-1.0) ** i * (2.0 + i) for i in range(heads_q)], device="cuda")
              if "sinks" in key.mods else None))
    options = dict(softcap=mods.softcap, alibi_slopes=mods.alibi, learnable_sink=mods.sink)
    return DTYPE_BY_NAME[key.dtype], key.head_dim, key.mask == "causal", window, mods, options


def runnable_entries(bundle):
    """The bundle's fp16 / bf16 forward kernels of the dense layout for this device, but for
    custom masks' (whose arguments tests/gpu/test_custom_mask.py makes)."""
    cc = torch.cuda.get_device_capability()
    return [e for e in bundle.kernels if e.key.startswith("fwd/") and runs_on(e, cc)
            and contract.KernelKey.parse(e.key).layout == "dense"  # paged: tests/gpu/test_kvcache.py
            and contract.KernelKey.parse(e.key).dtype in DTYPE_BY_NAME  # e4m3: tests/gpu/test_fp8.py
            and contract.KernelKey.parse(e.key).mask in contract.MASKS]


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): GQA, rows that see no key under the causal
# mask, many keys per query block. A local kernel runs with EVERY_KERNEL_WINDOW.
EVERY_KERNEL_WINDOW = (150, 70)
EVERY_KERNEL_SIZES = ((2, 300, 300, 4, 2), (1, 1000, 257, 3, 3), (2, 257, 1000, 3, 3))


@pytest.mark.parametrize("size", EVERY_KERNEL_SIZES, ids=lambda s: "x".join(map(str, s)))
def test_every_kernel_of_the_bundle(bundle, size):
    # Launched directly, not through selection: a key's kernels for short sequences
    # (max_seqlen_k) and its unbounded kernel each run at every size here.
    from fagen.torch.adapter import prepare_launch

    batch, seqlen_q, seqlen_k, heads_q, heads_kv = size
    entries = runnable_entries(bundle)
    if not entries:
        pytest.skip("the bundle has no forward kernel for this device")
    for entry in entries:
        dtype, head_dim, causal, window, mods, options = entry_call(entry, batch, heads_q)
        torch.manual_seed(seqlen_q + head_dim)
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, value_dim(entry))
        out = torch.full((batch, seqlen_q, heads_q, value_dim(entry)), math.nan, dtype=dtype, device="cuda")
        lse = torch.full((batch, heads_q, seqlen_q), math.nan, dtype=torch.float32, device="cuda")
        prepare_launch(bundle, entry, q, k, v, out, lse, window_size=window, **options)()
        torch.cuda.synchronize()
        try:
            assert_close_to_reference(out, lse, q, k, v, causal, window=window, mods=mods)
        except AssertionError as exc:
            raise AssertionError(f"{entry.name}: {exc}") from None


@pytest.mark.parametrize("seqlen", (1000, 1100), ids=("8qblocks", "9qblocks"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_more_work_than_two_rounds(bundle, head_dim, causal, seqlen):
    # Persistent kernels walk tiles (causal: pair items) round-robin (algo/tile_scheduler.cuh),
    # and early_first_qk kernels issue each tile's first Q K^T before the previous tile's
    # epilogue; the small sizes above fit in one round. 80 heads x 8-9 tiles (4-5 pair items):
    # two to five rounds on the H200's 132 SMs, an even and an odd number of query blocks of 128
    # rows (the odd one has a middle block paired with itself).
    check_case(bundle, 4, seqlen, seqlen, 20, 20, head_dim, torch.bfloat16, causal)


@pytest.mark.parametrize("heads", ((8, 1), (8, 4)), ids=("mqa8to1", "gqa2to1"))
@pytest.mark.parametrize("size", ((2, 300, 300), (2, 128, 300), (2, 300, 128)), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_grouped_query_attention(bundle, head_dim, causal, size, heads):
    check_case(bundle, *size, *heads, head_dim, torch.bfloat16, causal)


def _transposed(shape, dtype):
    batch, seqlen, heads, head_dim = shape
    return torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype).transpose(1, 2)


def _strided_last_dim(shape, dtype):
    return torch.randn(*shape[:3], 2 * shape[3], device="cuda", dtype=dtype)[..., ::2]


def _misaligned(shape, dtype):
    return torch.randn(math.prod(shape) + 1, device="cuda", dtype=dtype)[1:].view(shape)


def _padded_rows(shape, dtype):
    return torch.randn(*shape[:3], shape[3] + 8, device="cuda", dtype=dtype)[..., : shape[3]]


@pytest.mark.parametrize(
    "layout", (_transposed, _strided_last_dim, _misaligned, _padded_rows),
    ids=("transposed", "strided_last_dim", "misaligned", "padded_rows"),
)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_non_contiguous_inputs(bundle, layout, causal):
    head_dim, dtype = 128, torch.bfloat16
    require_kernel(bundle, dtype, head_dim, causal)
    torch.manual_seed(0)
    q = layout((2, 257, 4, head_dim), dtype)
    k = layout((2, 300, 2, head_dim), dtype)
    v = layout((2, 300, 2, head_dim), dtype)
    out, lse = run_poisoned(q, k, v, causal=causal)
    assert_close_to_reference(out, lse, q, k, v, causal)


def test_broadcast_kv(bundle):
    require_kernel(bundle, torch.bfloat16, 64, True)
    torch.manual_seed(1)
    q, k, v = random_qkv(3, 200, 250, 4, 2, 64, torch.bfloat16)
    k, v = k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)
    out, lse = run_poisoned(q, k, v, causal=True)
    assert_close_to_reference(out, lse, q, k, v, True)


def test_softmax_scale(bundle):
    require_kernel(bundle, torch.float16, 96, False)
    torch.manual_seed(2)
    q, k, v = random_qkv(2, 333, 333, 2, 2, 96, torch.float16)
    out, lse = run_poisoned(q, k, v, causal=False, softmax_scale=0.3)
    assert_close_to_reference(out, lse, q, k, v, False, scale=0.3)


def test_return_lse_shapes(bundle):
    require_kernel(bundle, torch.bfloat16, 64, False)
    q, k, v = random_qkv(2, 33, 65, 4, 2, 64, torch.bfloat16)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 33, 4, 64)
    out2, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out2.shape == (2, 33, 4, 64) and lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    assert torch.equal(out, out2)


def test_repeated_call_sees_new_contents(bundle):
    # The second call reuses the first one's prepared launch (same shapes and addresses); it
    # must still read what the tensors hold now, and an input freed and reallocated at the
    # same address must work as well.
    from fagen.torch import adapter

    require_kernel(bundle, torch.bfloat16, 128, True)
    q, k, v = random_qkv(2, 300, 300, 3, 3, 128, torch.bfloat16)
    flash_attn_func(q, k, v, causal=True)
    kept = len(adapter._prepared_launches)
    q.copy_(torch.randn_like(q))
    out, lse = run_poisoned(q, k, v, causal=True)
    assert len(adapter._prepared_launches) == kept, "the repeated call was prepared again"
    assert_close_to_reference(out, lse, q, k, v, True)
    del k
    k = torch.randn(2, 300, 3, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = run_poisoned(q, k, v, causal=True)
    assert_close_to_reference(out, lse, q, k, v, True)


def test_repeated_calls_keep_no_input_alive(bundle):
    import weakref

    require_kernel(bundle, torch.bfloat16, 64, False)
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    alive = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v
    assert all(ref() is None for ref in alive), "fagen kept a caller's tensor alive"


def test_side_stream(bundle):
    require_kernel(bundle, torch.bfloat16, 128, True)
    q, k, v = random_qkv(2, 512, 512, 4, 4, 128, torch.bfloat16)
    expected = flash_attn_func(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = flash_attn_func(q, k, v, causal=True)
    stream.synchronize()
    assert torch.equal(out, expected)


def test_cuda_graph_capture(bundle):
    require_kernel(bundle, torch.bfloat16, 128, False)
    q, k, v = random_qkv(2, 256, 256, 4, 4, 128, torch.bfloat16)
    expected = flash_attn_func(q, k, v)  # loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attn_func(q, k, v))
    assert not torch.equal(out, expected)


def test_torch_compile_fullgraph(bundle):
    require_kernel(bundle, torch.bfloat16, 128, True)

    def block(q, k, v):  # exact scalings only, so compiled and eager agree bit for bit
        return flash_attn_func(q * 0.5, k, v, causal=True) * 2

    q, k, v = random_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("size", ((0, 16, 16), (2, 0, 16), (2, 16, 0)), ids=("batch0", "seqlen_q0", "seqlen_k0"))
def test_empty_inputs(bundle, size):
    require_kernel(bundle, torch.bfloat16, 64, False)
    batch, seqlen_q, seqlen_k = size
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 2, 2, 64, torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (batch, seqlen_q, 2, 64) and lse.shape == (batch, 2, seqlen_q)
    if out.numel():
        assert (out == 0).all() and (lse == -math.inf).all()


def test_missing_head_dim_names_the_fix(bundle):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 40, torch.bfloat16)
    with pytest.raises(KernelNotFound, match=r"fwd/bf16/hd40/full[\s\S]*fagen build"):
        flash_attn_func(q, k, v)


def test_bad_dtype_is_rejected(bundle):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 64, torch.float32)
    with pytest.raises(TypeError, match="float32"):
        flash_attn_func(q, k, v)
