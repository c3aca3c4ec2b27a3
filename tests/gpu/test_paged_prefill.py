"""flash_attn_with_kvcache with many new query tokens (a prefill or a chunked prefill): the
paged layout's tile kernels (FA3, K/V gathered by TMA through the block table), checked per
batch row against the fp64 reference of its own unpaged keys, for contiguous caches and pages of
16 / 64 / 256 keys in random order, mixed lengths (a row shorter than its new tokens, one with
no key), GQA 4:1, windows, sinks and softcap, appends of a whole chunk, packed queries, and a
cache whose rows past each row's length hold NaN (which must not reach the output)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from test_kvcache import DTYPES, LAYOUTS, Cache, check_rows  # noqa: E402
from attention_reference import Mods, forward_failures  # noqa: E402
from test_fa2_fwd import poison_allocator  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound, call, kvcache  # noqa: E402
from fagen.torch import flash_attn_with_kvcache  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW = 160  # query tokens per row: above contract.PAGED_TILE_MIN_QUERIES, not a tile multiple


def require_tiles(bundle, dtype, head_dim, mods=()):
    """Skip unless the bundle has a tile kernel of the paged layout for this device."""
    key = contract.kernel_key("fwd", dtype, head_dim, "local", mods, layout="paged")
    for fa_version in kvcache.TILE_FA_VERSIONS:
        try:
            bundle.select(key, torch.cuda.get_device_capability(), fa_version=fa_version)
            return
        except KernelNotFound as exc:
            missing = exc
    pytest.skip(f"bundle has no tile kernel {key}: {str(missing).splitlines()[0]}")


def poison_past_lengths(cache: Cache) -> None:
    """NaN in every cache row past its row's length, and in the pages no row uses."""
    if cache.block_table is None:
        for b, n in enumerate(cache.lengths):
            cache.k[b, n:] = math.nan
            cache.v[b, n:] = math.nan
        return
    used = torch.zeros(cache.k.shape[:2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(cache.lengths):
        index = torch.arange(n, device="cuda")
        used[cache.block_table[b].long()[index // cache.page_size], index % cache.page_size] = True
    cache.k[~used] = math.nan
    cache.v[~used] = math.nan


def selected(bundle, q, cache, dtype, head_dim, mods=()):
    problem = call.Problem(dtype, True, q.shape[0], q.shape[1], cache.k.shape[1] if cache.block_table is None
                           else cache.block_table.shape[1] * cache.page_size, q.shape[2], cache.k.shape[2],
                           head_dim, score=contract.Score(20.0 if "softcap" in mods else 0.0, False, "sinks" in mods),
                           layout="paged")
    return kvcache.select_kvcache(bundle, problem)


def run(bundle, q, cache, **kwargs):
    poison_allocator(((*q.shape[:3], cache.v.shape[3]), q.dtype), ((q.shape[0], q.shape[2], q.shape[1]), torch.float32))
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens, block_table=cache.block_table,
                                       return_softmax_lse=True, bundle=bundle, **kwargs)
    torch.cuda.synchronize()
    return out, lse


LENGTHS = [0, 100, NEW, 700, 2049]  # 0 and 100: rows with fewer keys than new tokens


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_layouts(bundle, layout, dtype, head_dim):
    """NEW causal query tokens per row over its cache (the new ones its last keys), GQA 4:1."""
    require_tiles(bundle, dtype, head_dim)
    torch.manual_seed(head_dim)
    cache = Cache(LENGTHS, 2, head_dim, DTYPES[dtype], LAYOUTS[layout], seed=head_dim)
    poison_past_lengths(cache)
    q = torch.randn(len(LENGTHS), NEW, 8, head_dim, device="cuda", dtype=DTYPES[dtype])
    assert selected(bundle, q, cache, dtype, head_dim).launch.grid != "splits"
    out, lse = run(bundle, q, cache, causal=True)
    check_rows(out, lse, q, cache, True)


@pytest.mark.parametrize("window", [(0, 0), (127, 0), (128, 0), (129, 4), (4096, 0)])
def test_windows(bundle, window):
    require_tiles(bundle, "bf16", 128)
    cache = Cache([300, 1500], 2, 128, torch.bfloat16, 64, seed=3)
    poison_past_lengths(cache)
    q = torch.randn(2, NEW, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = run(bundle, q, cache, causal=window[1] == 0, window_size=window)
    check_rows(out, lse, q, cache, window[1] == 0, window)


def test_not_causal(bundle):
    require_tiles(bundle, "bf16", 128)
    cache = Cache([200, 900], 2, 128, torch.bfloat16, 16, seed=4)
    poison_past_lengths(cache)
    q = torch.randn(2, NEW, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = run(bundle, q, cache, causal=False)
    check_rows(out, lse, q, cache, False)


@pytest.mark.parametrize("mod", ["softcap", "sinks"])
def test_score_modifiers(bundle, mod):
    head_dim = 256 if mod == "softcap" else 64
    require_tiles(bundle, "bf16", head_dim, (mod,))
    cache = Cache([130, 1000], 2, head_dim, torch.bfloat16, 16, magnitude=4.0, seed=7)
    poison_past_lengths(cache)
    q = torch.randn(2, NEW, 8, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    if mod == "softcap":
        out, lse = run(bundle, q, cache, causal=True, softcap=20.0)
        check_rows(out, lse, q, cache, True, mods=Mods(softcap=20.0))
    else:
        sink = torch.linspace(-4, 6, 8, device="cuda")
        out, lse = run(bundle, q, cache, causal=True, window_size=(127, 0), learnable_sink=sink)
        check_rows(out, lse, q, cache, True, (127, 0), Mods(sink=sink))


@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_append_a_chunk(bundle, page_size):
    """Chunked prefill: NEW keys and values appended at each row's length (crossing pages), then
    the NEW queries attend over the cache and them."""
    require_tiles(bundle, "bf16", 128)
    lengths = [0, 15, 600]
    cache = Cache(lengths, 2, 128, torch.bfloat16, page_size, capacity=1024, seed=8)
    q = torch.randn(3, NEW, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(3, NEW, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(3, NEW, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, k_new, v_new, cache_seqlens=cache.seqlens,
                                       block_table=cache.block_table, causal=True, return_softmax_lse=True,
                                       bundle=bundle)
    torch.cuda.synchronize()
    cache.lengths = [n + NEW for n in lengths]
    for b, n in enumerate(lengths):
        k, v = cache.keys_of(b)
        assert torch.equal(k[0, n:], k_new[b]) and torch.equal(v[0, n:], v_new[b]), f"row {b}: appended rows"
    check_rows(out, lse, q, cache, True)


def test_packed_queries(bundle):
    """vLLM's mixed batch: packed query tokens of prefills and decodes over a paged cache."""
    require_tiles(bundle, "bf16", 128)
    lengths, new = [300, 2048, 5, 1200], [300, 129, 1, 0]
    cache = Cache(lengths, 2, 128, torch.bfloat16, 16, seed=9)
    poison_past_lengths(cache)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(new), 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_with_kvcache(q, cache.k, cache.v, cache_seqlens=cache.seqlens, block_table=cache.block_table,
                                       cu_seqlens_q=cu, max_seqlen_q=max(new), causal=True,
                                       return_softmax_lse=True, bundle=bundle)
    torch.cuda.synchronize()
    failures = []
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if new[b] == 0:
            continue
        k, v = cache.keys_of(b)
        failures += forward_failures(out[rows][None], lse[:, rows][None], q[rows][None], k, v, True)
    assert not failures, "; ".join(failures)


def test_tiles_equal_the_split_kernels(bundle):
    """The same prefill through the split-KV kernels (num_splits=2 asks for them): both answers
    within each other's rounding."""
    require_tiles(bundle, "bf16", 128)
    cache = Cache([500, 1300], 2, 128, torch.bfloat16, 64, seed=10)
    q = torch.randn(2, NEW, 8, 128, device="cuda", dtype=torch.bfloat16)
    tiles, _ = run(bundle, q, cache, causal=True)
    split, _ = run(bundle, q, cache, causal=True, num_splits=2)
    assert (tiles.float() - split.float()).abs().max() < 2e-2
