"""flash_attn_with_kvcache over an FP8 (float8_e4m3fn) KV cache on the GPU (the split-KV kernels
of kv_dtype e4m3, which widen the cache's bytes to the queries' fp16 / bf16 in registers).

The widening is checked bit for bit over every e4m3 code (subnormals included); whole calls
against the fp64 reference of the dequantised cache (stored values times their descales, in
fp32: attention_reference's rule, whose low-precision baseline rounds them to the queries'
type), for contiguous and paged caches, descales per tensor and per (batch row, KV head), mixed
lengths with 0 and 1, speculative tokens, the softcap and sinks kernels, appends of e4m3 rows,
and the refusals."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attention_reference import Mods  # noqa: E402
from test_kvcache import Cache, check_rows  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_with_kvcache, quantize_e4m3  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E4M3 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def require(bundle, dtype, head_dim, mods=()):
    key = contract.kernel_key("fwd", dtype, head_dim, "local", mods, layout="paged", kv_dtype="e4m3")
    try:
        bundle.select(key, torch.cuda.get_device_capability())
    except KernelNotFound as exc:
        pytest.skip(f"bundle has no {key}: {str(exc).splitlines()[0]}")


def every_finite_code(count: int) -> torch.Tensor:
    """`count` e4m3 values cycling through all 254 finite codes (0x7f and 0xff are NaN)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    return codes[torch.arange(count, device="cuda") % codes.numel()].view(E4M3)


class Fp8Cache:
    """`cache`'s keys and values quantised to e4m3 (per tensor by fagen.torch.quantize_e4m3, or
    per (batch row, KV head) for a contiguous cache, every other head's descale halved so that
    its largest values saturate): `k8`, `v8` and their descales for the call, and `reference`,
    the same Cache holding the dequantised values in fp32 for check_rows."""

    def __init__(self, cache: Cache, per_head: bool):
        self.reference = cache
        self.descales = {}
        for name in ("k", "v"):
            x = getattr(cache, name).float()
            if per_head:
                descale = x.abs().amax(dim=(1, 3)) / 448 * torch.tensor([0.5, 1.0], device="cuda").repeat(
                    x.shape[2])[:x.shape[2]]  # heads quantised to different ranges (some saturate)
                stored = (x / descale[:, None, :, None]).clamp(-448, 448).to(E4M3)
                value = stored.float() * descale[:, None, :, None]
            else:
                stored, descale = quantize_e4m3(x)
                value = stored.float() * descale
            setattr(self, f"{name}8", stored)
            setattr(cache, name, value)
            self.descales[f"{name}_descale"] = descale


def call(bundle, q, fp8: Fp8Cache, **kwargs):
    cache = fp8.reference
    out, lse = flash_attn_with_kvcache(q, fp8.k8, fp8.v8, cache_seqlens=cache.seqlens, block_table=cache.block_table,
                                       return_softmax_lse=True, bundle=bundle, **fp8.descales, **kwargs)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_widening_is_exact(bundle, dtype, head_dim):
    """One key per row: the output is v_descale times V's row and the LSE softmax_scale times
    q . k, so with power-of-two descales and one-hot queries both are exact, and every finite
    e4m3 code of K and V must come back bit for bit (subnormals included)."""
    require(bundle, dtype, head_dim)
    torch_dtype = DTYPES[dtype]
    batch, heads_kv, group, seqlen_q = 4, 2, 8, 8
    k8 = every_finite_code(batch * heads_kv * head_dim).view(batch, 1, heads_kv, head_dim)
    v8 = every_finite_code(batch * heads_kv * head_dim + 77)[77:].clone().view(batch, 1, heads_kv, head_dim)
    # Query (token t, head g of its group) is one-hot at column 8 g + t: q . k is k[8 g + t].
    q = torch.zeros(batch, seqlen_q, heads_kv * group, head_dim, device="cuda", dtype=torch_dtype)
    for t in range(seqlen_q):
        for h in range(heads_kv * group):
            q[:, t, h, (8 * (h % group) + t) % head_dim] = 1.0
    k_descale = torch.tensor([[0.25, 2.0]] * batch, device="cuda")
    v_descale = torch.tensor([[0.5, 4.0]] * batch, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k8, v8, k_descale=k_descale, v_descale=v_descale, softmax_scale=1.0,
                                       return_softmax_lse=True, bundle=bundle)
    torch.cuda.synchronize()
    kv_head = torch.arange(heads_kv * group, device="cuda") // group
    expected_out = (v8.float() * v_descale[:, None, :, None])[:, :, kv_head].expand(-1, seqlen_q, -1, -1)
    assert torch.equal(out, expected_out.to(torch_dtype)), "V's widening is not exact"
    column = (8 * (torch.arange(heads_kv * group, device="cuda") % group)[:, None]
              + torch.arange(seqlen_q, device="cuda")[None]) % head_dim  # (head, token)
    k_scaled = k8.float()[:, 0] * k_descale[:, :, None]  # (batch, kv head, d)
    expected_lse = torch.gather(k_scaled[:, kv_head], 2, column[None].expand(batch, -1, -1))
    torch.testing.assert_close(lse, expected_lse, rtol=2e-6, atol=1e-6, msg="K's widening is not exact")


LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}
LENGTHS = [0, 1, 17, 300, 1000, 2049]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode(bundle, layout, dtype, head_dim):
    """One new token per row, GQA 4:1, causal; paged caches in random order with a shared
    prefix; descales per tensor (paged) or per (batch row, KV head) (contiguous)."""
    require(bundle, dtype, head_dim)
    page_size = LAYOUTS[layout]
    cache = Cache(LENGTHS, 2, head_dim, torch.float32, page_size, shared_prefix=64 if page_size else 0,
                  magnitude=4.0, seed=head_dim)
    fp8 = Fp8Cache(cache, per_head=page_size is None)
    q = torch.randn(len(LENGTHS), 1, 8, head_dim, device="cuda", dtype=DTYPES[dtype])
    out, lse = call(bundle, q, fp8, causal=True)
    check_rows(out, lse, q, cache, True)


@pytest.mark.parametrize("seqlen_q", [3, 8])
@pytest.mark.parametrize("num_splits", [1, 5, 0])
def test_speculative_tokens_and_splits(bundle, seqlen_q, num_splits):
    require(bundle, "bf16", 128)
    cache = Cache([0, 5, 300, 4000], 2, 128, torch.float32, 64, seed=seqlen_q)
    fp8 = Fp8Cache(cache, per_head=False)
    q = torch.randn(4, seqlen_q, 16, 128, device="cuda", dtype=torch.bfloat16) * 4
    out, lse = call(bundle, q, fp8, causal=True, num_splits=num_splits)
    check_rows(out, lse, q, cache, True)


@pytest.mark.parametrize("mod", ["softcap", "sinks"])
def test_score_modifiers(bundle, mod):
    """The softcap takes the descales in its own scale, the sinks join each row's softmax."""
    head_dim = 256 if mod == "softcap" else 64
    require(bundle, "bf16", head_dim, (mod,))
    cache = Cache([0, 1, 40, 900], 2, head_dim, torch.float32, None, magnitude=8.0, seed=3)
    fp8 = Fp8Cache(cache, per_head=True)
    q = torch.randn(4, 2, 8, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    if mod == "softcap":
        out, lse = call(bundle, q, fp8, causal=True, softcap=20.0)
        mods = Mods(softcap=20.0)
    else:
        sink = torch.linspace(-3, 3, 8, device="cuda")
        out, lse = call(bundle, q, fp8, causal=True, learnable_sink=sink)
        mods = Mods(sink=sink)
    check_rows(out, lse, q, cache, True, mods=mods)


def test_window(bundle):
    require(bundle, "bf16", 128)
    cache = Cache([3000, 700], 2, 128, torch.float32, 16, seed=9)
    fp8 = Fp8Cache(cache, per_head=False)
    q = torch.randn(2, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = call(bundle, q, fp8, causal=True, window_size=(255, 0))
    check_rows(out, lse, q, cache, True, window=(255, 0))


def test_e4m3_queries(bundle):
    """float8_e4m3fn q runs as bf16 (exact) with q_descale folded into the scores: out is bf16."""
    require(bundle, "bf16", 128)
    cache = Cache([50, 1200], 2, 128, torch.float32, None, seed=4)
    fp8 = Fp8Cache(cache, per_head=True)
    q = torch.randn(2, 1, 8, 128, device="cuda") * 3
    q_descale = torch.tensor([1 / 64], device="cuda")  # a power of two: q8 * q_descale is exact in bf16
    q8 = (q / q_descale).clamp(-448, 448).to(E4M3)
    out, lse = call(bundle, q8, fp8, q_descale=q_descale)
    q_value = (q8.float() * q_descale).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    check_rows(out, lse, q_value, cache, False)


@pytest.mark.parametrize("page_size", [None, 16])
def test_append(bundle, page_size):
    """e4m3 rows k, v go into the cache bytes as they are (across a page boundary), then the call
    attends over them."""
    require(bundle, "bf16", 128)
    lengths = [0, 14, 15, 200]
    cache = Cache(lengths, 2, 128, torch.float32, page_size, capacity=256, seed=5)
    fp8 = Fp8Cache(cache, per_head=False)
    k_scale, v_scale = fp8.descales["k_descale"], fp8.descales["v_descale"]
    k_new = (torch.randn(4, 3, 2, 128, device="cuda") / k_scale).clamp(-448, 448).to(E4M3)
    v_new = (torch.randn(4, 3, 2, 128, device="cuda") / v_scale).clamp(-448, 448).to(E4M3)
    q = torch.randn(4, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = cache.seqlens
    out, lse = flash_attn_with_kvcache(q, fp8.k8, fp8.v8, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=cache.block_table, causal=True, return_softmax_lse=True,
                                       bundle=bundle, **fp8.descales)
    torch.cuda.synchronize()
    stored = Cache.__new__(Cache)
    stored.lengths, stored.page_size, stored.block_table = [n + 3 for n in lengths], page_size, cache.block_table
    stored.k, stored.v = fp8.k8.view(torch.uint8), fp8.v8.view(torch.uint8)
    for b, n in enumerate(lengths):
        k, v = stored.keys_of(b)
        assert torch.equal(k[0, n:], k_new[b].view(torch.uint8)) and torch.equal(v[0, n:], v_new[b].view(torch.uint8))
    cache.lengths = stored.lengths
    cache.k, cache.v = fp8.k8.float() * k_scale, fp8.v8.float() * v_scale
    check_rows(out, lse, q, cache, True)


def test_refusals(bundle):
    require(bundle, "bf16", 128)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k8 = torch.randn(2, 64, 2, 128, device="cuda").to(E4M3)
    bf16_cache = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 cache"):
        flash_attn_with_kvcache(q, bf16_cache, bf16_cache, k_descale=torch.ones(1, device="cuda"), bundle=bundle)
    with pytest.raises(TypeError, match="cache's dtype"):
        flash_attn_with_kvcache(q, k8, bf16_cache, bundle=bundle)
    with pytest.raises(TypeError, match="cache's dtype"):
        flash_attn_with_kvcache(q, k8, k8, bf16_cache[:, :1], bf16_cache[:, :1], cache_seqlens=3, bundle=bundle)
    with pytest.raises(ValueError, match="k_descale must be a float32"):
        flash_attn_with_kvcache(q, k8, k8, k_descale=torch.ones(3, 2, device="cuda"), bundle=bundle)
    with pytest.raises(KernelNotFound, match="bf16-e4m3/hd96"):
        flash_attn_with_kvcache(q[..., :96], k8[..., :96], k8[..., :96], bundle=bundle)
    assert math.isfinite(flash_attn_with_kvcache(q, k8, k8, bundle=bundle).float().abs().max().item())
