"""flash_attn_with_kvcache on the GPU (the paged layout's split-KV kernels): every batch row is
checked against the fp64 reference of its own unpaged keys (attention_reference's rule), for
contiguous and paged caches (page sizes 16 / 64 / 256, pages in random order, pages shared
between rows), mixed lengths with 0 and 1, one to eight new tokens (causal, bottom-right),
GQA 8:1 / 4:1, MQA and MHA, windows, softcap and sinks, forced and automatic split counts, appends
that cross a page, packed queries (vLLM's call), and a CUDA graph replayed with new contents."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attention_reference import Mods, forward_failures  # noqa: E402
from test_fa2_fwd import poison_allocator  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_with_kvcache, quantize_e4m3  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def require(bundle, dtype, head_dim, mods=()):
    key = contract.kernel_key("fwd", dtype, head_dim, "local", mods, layout="paged")
    try:
        bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key}: {str(exc).splitlines()[0]}")


class Cache:
    """A KV cache of `lengths` keys per row, contiguous (page_size None) or paged: pages in a
    random order, and with `shared_prefix` keys of row 0's first pages shared by every row."""

    def __init__(self, lengths, heads_kv, head_dim, dtype, page_size=None, capacity=None, shared_prefix=0,
                 magnitude=1.0, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.lengths = list(lengths)
        batch = len(lengths)
        capacity = capacity or max(max(lengths), 1)
        self.page_size = page_size
        if page_size is None:
            self.k = torch.randn(batch, capacity, heads_kv, head_dim, device="cuda", generator=gen) * magnitude
            self.v = torch.randn(batch, capacity, heads_kv, head_dim, device="cuda", generator=gen)
            self.k, self.v = self.k.to(dtype), self.v.to(dtype)
            self.block_table = None
            return
        per_row = -(-capacity // page_size)
        shared = shared_prefix // page_size
        pages = batch * per_row + 3  # spare pages nobody uses
        self.k = (torch.randn(pages, page_size, heads_kv, head_dim, device="cuda", generator=gen) * magnitude).to(dtype)
        self.v = torch.randn(pages, page_size, heads_kv, head_dim, device="cuda", generator=gen).to(dtype)
        order = torch.randperm(pages, device="cuda", generator=gen)
        table = order[:batch * per_row].view(batch, per_row).to(torch.int32).clone()
        table[1:, :shared] = table[0, :shared]  # a shared prompt prefix
        self.block_table = table

    def keys_of(self, b):
        """Row b's keys and values, unpaged: (1, length, heads_kv, d)."""
        n = self.lengths[b]
        if self.block_table is None:
            return self.k[b:b + 1, :n], self.v[b:b + 1, :n]
        index = torch.arange(n, device="cuda")
        pages = self.block_table[b].long()[index // self.page_size]
        return self.k[pages, index % self.page_size][None], self.v[pages, index % self.page_size][None]

    @property
    def seqlens(self):
        return torch.tensor(self.lengths, dtype=torch.int32, device="cuda")


def check_rows(out, lse, q, cache, causal, window=(-1, -1), mods=Mods(), scale=None):
    """Every batch row against the reference of its own keys."""
    failures = []
    for b in range(q.shape[0]):
        k, v = cache.keys_of(b)
        if k.shape[1] == 0:  # no key: zeros and -inf (a sink alone: LSE = the sink, O = 0)
            empty = (mods.sink.view(-1, 1).expand_as(lse[b]) if mods.sink is not None
                     else torch.full_like(lse[b], -math.inf))
            if not (out[b] == 0).all() or not torch.allclose(lse[b], empty.float(), rtol=1e-6, atol=0):
                failures.append(f"row {b} (no keys): not zeros / {'sink' if mods.sink is not None else '-inf'}")
            continue
        row_lse = None if lse is None else lse[b:b + 1]
        found = forward_failures(out[b:b + 1], row_lse, q[b:b + 1], k, v, causal, scale, window, mods)
        failures += [f"row {b} ({k.shape[1]} keys): {f}" for f in found]
    assert not failures, "; ".join(failures)


def run(bundle, q, cache, **kwargs):
    poison_allocator(((*q.shape[:3], cache.v.shape[3]), q.dtype), ((q.shape[0], q.shape[2], q.shape[1]), torch.float32))
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens,
                                       block_table=cache.block_table, return_softmax_lse=True, bundle=bundle,
                                       **kwargs)
    torch.cuda.synchronize()
    return out, lse


LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64, "paged256": 256}
LENGTHS = [0, 1, 17, 300, 1000, 2049]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_layouts(bundle, layout, dtype, head_dim):
    """One new token per row, GQA 4:1, mixed lengths, every page size."""
    require(bundle, dtype, head_dim)
    torch.manual_seed(head_dim)
    cache = Cache(LENGTHS, 2, head_dim, DTYPES[dtype], LAYOUTS[layout], shared_prefix=256 if layout == "paged16" else 0)
    q = torch.randn(len(LENGTHS), 1, 8, head_dim, device="cuda", dtype=DTYPES[dtype])
    out, lse = run(bundle, q, cache, causal=True)
    check_rows(out, lse, q, cache, True)


@pytest.mark.parametrize("seqlen_q", [2, 5, 8])
@pytest.mark.parametrize("heads", [(8, 1), (4, 4), (16, 16)], ids=["gqa8", "mha4", "mha16"])
@pytest.mark.parametrize("causal", [True, False])
def test_speculative_tokens(bundle, seqlen_q, heads, causal):
    """2-8 new tokens per row (bottom-right causal: token i sees its own key and those before)."""
    require(bundle, "bf16", 128)
    heads_q, heads_kv = heads
    torch.manual_seed(seqlen_q)
    cache = Cache([seqlen_q, 40, 333, 4096], heads_kv, 128, torch.bfloat16, 64)
    q = torch.randn(4, seqlen_q, heads_q, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = run(bundle, q, cache, causal=causal)
    check_rows(out, lse, q, cache, causal)


@pytest.mark.parametrize("num_splits", [1, 3, 7, 64, 0])
def test_split_counts(bundle, num_splits):
    """Any split count gives the unsplit result to the reference's bar, including more splits
    than key blocks."""
    require(bundle, "bf16", 128)
    cache = Cache([5, 700, 3000], 8, 128, torch.bfloat16, 16, seed=1)
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = run(bundle, q, cache, causal=True, num_splits=num_splits)
    check_rows(out, lse, q, cache, True)


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (127, 0), (128, 0), (129, 0), (4096, 0), (100, 3)])
def test_windows(bundle, window):
    require(bundle, "bf16", 128)
    cache = Cache([1, 129, 1000, 5000], 2, 128, torch.bfloat16, 64, seed=2)
    q = torch.randn(4, 4, 4, 128, device="cuda", dtype=torch.bfloat16)
    causal = window[1] == 0
    out, lse = run(bundle, q, cache, causal=causal, window_size=window)
    check_rows(out, lse, q, cache, causal, window)


@pytest.mark.parametrize("mod", ["softcap", "sinks"])
def test_score_modifiers(bundle, mod):
    head_dim = 256 if mod == "softcap" else 64
    require(bundle, "bf16", head_dim, (mod,))
    cache = Cache([0, 3, 800, 2500], 2, head_dim, torch.bfloat16, 16, magnitude=4.0, seed=3)
    q = (torch.randn(4, 2, 8, head_dim, device="cuda") * 4).to(torch.bfloat16)
    if mod == "softcap":
        mods, kwargs = Mods(softcap=30.0), {"softcap": 30.0}
    else:
        sink = torch.tensor([-20.0, -1.0, 0.0, 0.5, 2.0, 5.0, 20.0, 1.0], device="cuda")
        mods, kwargs = Mods(sink=sink), {"learnable_sink": sink}
    for splits in (1, 5):
        out, lse = run(bundle, q, cache, causal=True, window_size=(1000, 0), num_splits=splits, **kwargs)
        check_rows(out, lse, q, cache, True, (1000, 0), mods)


def test_large_scores(bundle):
    """Inputs x16 and a large softmax_scale: one key takes each row."""
    require(bundle, "bf16", 128)
    cache = Cache([1, 50, 2000], 2, 128, torch.bfloat16, 64, magnitude=16.0, seed=4)
    q = (torch.randn(3, 1, 8, 128, device="cuda") * 16).to(torch.bfloat16)
    for splits in (1, 6):
        out, lse = run(bundle, q, cache, causal=True, softmax_scale=0.5, num_splits=splits)
        check_rows(out, lse, q, cache, True, scale=0.5)


@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_append(bundle, page_size):
    """k, v of three new tokens go into the cache at each row's length (across a page boundary
    for rows at 14-16 keys of 16), then every row attends over cache_seqlens + 3 keys."""
    require(bundle, "bf16", 128)
    lengths = [0, 14, 15, 16, 200]
    cache = Cache(lengths, 2, 128, torch.bfloat16, page_size, capacity=256, seed=5)
    cached = [cache.keys_of(b)[0].clone() for b in range(len(lengths))]
    q = torch.randn(5, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(5, 3, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(5, 3, 2, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = cache.seqlens
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=cache.block_table, causal=True, return_softmax_lse=True,
                                       bundle=bundle)
    torch.cuda.synchronize()
    assert torch.equal(seqlens, cache.seqlens), "cache_seqlens is the caller's: unchanged"
    cache.lengths = [n + 3 for n in lengths]
    for b, n in enumerate(lengths):
        k, v = cache.keys_of(b)
        assert torch.equal(k[0, n:], k_new[b]) and torch.equal(v[0, n:], v_new[b]), f"row {b}: appended rows"
        assert torch.equal(k[:, :n], cached[b]), f"row {b}: the cached rows are untouched"
    check_rows(out, lse, q, cache, True)


def test_appends_never_write_outside_the_cache(bundle):
    """The append kernel skips keys past a row's capacity and pages outside [0, pages): the rest
    of the cache keeps every bit (no write lands where the host could not check)."""
    require(bundle, "bf16", 128)
    cache = Cache([10, 30, 60], 2, 128, torch.bfloat16, 16, capacity=64, seed=9)
    cache.block_table[0, 1] = -1  # row 0's keys 16..31: a bad page
    cache.block_table[1, 1] = cache.k.shape[0]  # row 1's keys 16..31: past the pool
    before_k, before_v = cache.k.clone(), cache.v.clone()
    q = torch.randn(3, 8, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(3, 8, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(3, 8, 2, 128, device="cuda", dtype=torch.bfloat16)
    flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=cache.seqlens,
                            block_table=cache.block_table, causal=True, bundle=bundle)
    torch.cuda.synchronize()
    written = torch.zeros(cache.k.shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(cache.lengths):
        for t in range(8):
            key = n + t
            page = int(cache.block_table[b, key // 16]) if key < 64 else -1
            if 0 <= page < cache.k.shape[0]:
                written[page, key % 16] = True
                assert torch.equal(cache.k[page, key % 16], k_new[b, t]), f"row {b} key {key}"
    # row 0: keys 10..15, then the page of -1; row 1: the page past the pool, then 32..37; row 2: 60..63
    assert written.sum() == 6 + 6 + 4
    assert torch.equal(cache.k[~written], before_k[~written]) and torch.equal(cache.v[~written], before_v[~written])


def test_appends_in_a_graph_and_compiled(bundle):
    """A decode step with its append, captured and replayed twice (each replay appends at the
    lengths it finds), and the same call under torch.compile (the append op mutates the cache)."""
    require(bundle, "bf16", 128)
    cache = Cache([5, 40], 2, 128, torch.bfloat16, 16, capacity=128, seed=10)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = cache.seqlens
    path = str(bundle.path)

    def step():
        return flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=cache.block_table, causal=True, bundle=path)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        seqlens += 1
        cache.lengths = [n + 1 for n in cache.lengths]
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        cache.lengths = [n + 1 for n in cache.lengths]  # the replay's appended key
        check_rows(out, None, q, cache, True)
        cache.lengths = [n - 1 for n in cache.lengths]
    compiled = torch.compile(step, fullgraph=True)
    seqlens += 1
    cache.lengths = [n + 2 for n in cache.lengths]
    got = compiled()
    torch.cuda.synchronize()
    check_rows(got, None, q, cache, True)
    for b, n in enumerate(cache.lengths):
        assert torch.equal(cache.keys_of(b)[0][0, n - 1], k_new[b, 0])


def test_packed_queries(bundle):
    """vLLM's call: packed query tokens (cu_seqlens_q, max_seqlen_q) over a paged cache."""
    require(bundle, "bf16", 128)
    lengths, new = [7, 300, 1, 2048], [1, 4, 1, 8]
    cache = Cache(lengths, 2, 128, torch.bfloat16, 16, seed=6)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(new), 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens, block_table=cache.block_table,
                                       cu_seqlens_q=cu, max_seqlen_q=max(new), causal=True,
                                       return_softmax_lse=True, bundle=bundle)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (8, sum(new))
    failures = []
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        k, v = cache.keys_of(b)
        failures += forward_failures(out[rows][None], lse[:, rows][None], q[rows][None], k, v, True)
    assert not failures, "; ".join(failures)


def test_cuda_graph_replay(bundle):
    """A captured decode step replays with new cache contents, lengths and block table."""
    require(bundle, "bf16", 128)
    cache = Cache([100, 2000, 30], 2, 128, torch.bfloat16, 64, capacity=4096, seed=7)
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = cache.seqlens
    flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
                            causal=True, bundle=bundle)  # loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, block_table=cache.block_table,
                                      causal=True, bundle=bundle)
    for step in range(3):
        cache.k.copy_(torch.randn_like(cache.k))
        q.copy_(torch.randn_like(q))
        cache.lengths = [100 + 500 * step, 2000 - 600 * step, 30 + step]
        seqlens.copy_(cache.seqlens)
        cache.block_table.copy_(cache.block_table.roll(1, 1))
        graph.replay()
        torch.cuda.synchronize()
        failures = []
        for b in range(3):
            k, v = cache.keys_of(b)
            failures += forward_failures(out[b:b + 1], None, q[b:b + 1], k, v, True)
        assert not failures, f"replay {step}: " + "; ".join(failures)


def test_refusals(bundle):
    require(bundle, "bf16", 128)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(6, 24, 2, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="page_size=24"):
        flash_attn_with_kvcache(q, k, k, cache_seqlens=4, block_table=table, bundle=bundle)
    with pytest.raises(TypeError, match="int32"):
        flash_attn_with_kvcache(q, k[:2], k[:2], cache_seqlens=torch.ones(2, device="cuda"), bundle=bundle)
    with pytest.raises(NotImplementedError, match="rotary"):
        flash_attn_with_kvcache(q, k[:2], k[:2], rotary_cos=q, bundle=bundle)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q, k[:2], k[:2], num_splits=65, bundle=bundle)


def test_every_paged_kernel_of_the_bundle(bundle):
    """Each paged kernel launched directly (not through selection), paged 16 and split in 3, GQA
    4:1, two new causal tokens, with its score modifier where it has one."""
    from fagen.runtime import call, kvcache
    from fagen.runtime.loader import runs_on
    from fagen.torch.adapter import _current_stream

    cc = torch.cuda.get_device_capability()
    entries = [e for e in bundle.kernels if e.key.startswith("fwd/") and runs_on(e, cc)
               and contract.KernelKey.parse(e.key).layout == "paged"]
    if not entries:
        pytest.skip("the bundle has no paged kernel for this device")
    for entry in entries:
        key = contract.KernelKey.parse(entry.key)
        dtype = DTYPES[key.dtype]
        cache = Cache([0, 20, 700], 2, key.head_dim, dtype, 16, seed=key.head_dim)
        cache_k, cache_v, descales = cache.k, cache.v, None
        if key.kv_dtype == "e4m3":  # an FP8 cache: its bytes to the kernel, their values to the reference
            stored = {}
            for name in ("k", "v"):
                stored[name] = quantize_e4m3(getattr(cache, name))
                setattr(cache, name, stored[name][0].float() * stored[name][1])
            (cache_k, k_descale), (cache_v, v_descale) = stored["k"], stored["v"]  # alive through the launch
            descales = call.Descales(k=k_descale.data_ptr(), v=v_descale.data_ptr())
        q = torch.randn(3, 2, 8, key.head_dim, device="cuda", dtype=dtype)
        out = torch.full((3, 2, 8, key.head_dim), math.nan, device="cuda", dtype=dtype)
        lse = torch.full((3, 8, 2), math.nan, device="cuda")
        mods, score, arrays = Mods(), contract.Score(), call.ScoreTensors()
        sink = torch.linspace(-3, 3, 8, device="cuda")
        if "softcap" in key.mods:
            mods, score = Mods(softcap=20.0), contract.Score(20.0)
        if "sinks" in key.mods:
            mods, score, arrays = Mods(sink=sink), contract.Score(sinks=True), call.ScoreTensors(sinks=sink.data_ptr())
        problem = call.Problem(key.dtype, True, 3, 2, cache.block_table.shape[1] * 16, 8, 2, key.head_dim,
                               score=score, layout="paged", kv_dtype=key.kv_dtype)
        tensors = [call.Tensor(t.data_ptr(), *t.stride()[:3]) for t in (q, cache_k, cache_v, out)]
        seqlens = cache.seqlens
        prepared = kvcache.prepare_kvcache(
            bundle, problem, *tensors,
            kvcache.KvCache(seqused_k=seqlens.data_ptr(), block_table=cache.block_table.data_ptr(),
                            block_table_batch_stride=cache.block_table.stride(0), page_size=16,
                            pages=cache.k.shape[0]),
            num_splits=3, entry=entry, score_tensors=arrays, descales=descales)
        workspace = torch.empty(prepared.workspace.floats, device="cuda")
        prepared.launch(out.data_ptr(), lse.data_ptr(), _current_stream(0), workspace.data_ptr())
        torch.cuda.synchronize()
        try:
            check_rows(out, lse, q, cache, True, mods=mods)
        except AssertionError as exc:
            raise AssertionError(f"{entry.name}: {exc}") from None
