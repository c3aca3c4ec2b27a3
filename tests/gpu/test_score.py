"""The score modifiers (softcap, ALiBi, attention sinks: templates/include/fagen/algo/score.cuh and
the sink terms of algo/online_softmax.cuh and algo/backward_rows.cuh) on the GPU: forward and
backward, the sink's gradient included, against the fp64 reference under attention_reference's
rule, with every mask, seqlen_q != seqlen_k both ways (rows that see no key), GQA, odd sizes and
large scores; the deterministic mode bitwise. Skips what the bundle under test lacks: the default
bundle has the model families' variants, tests/gpu/score_variants.yaml builds the rest."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attention_reference import Mods, forward_failures, geometric_alibi_slopes, gradient_failures  # noqa: E402
from test_fa2_fwd import poison_allocator, require_kernel  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (window_size, causal): full, causal, a causal window (local), a two-sided window (local).
MASKS = {"full": ((-1, -1), False), "causal": ((-1, -1), True), "causal-window": ((100, 0), True),
         "window": ((64, 32), False)}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SIZES = ((1, 1, 1, 1, 1), (2, 300, 300, 4, 2), (1, 77, 700, 3, 1), (2, 700, 77, 2, 2), (1, 1100, 1100, 2, 2))
SIZE_IDS = ["x".join(map(str, s)) for s in SIZES]


def alibi_slopes(batch, heads, per_batch, device):
    """ALiBi's geometric slopes 2^(-8 i / heads), and per batch scaled by 1 + batch / 4."""
    slopes = geometric_alibi_slopes(heads, device)
    if per_batch:
        slopes = slopes[None, :] * (1 + torch.arange(batch, device=device)[:, None] / 4)
    return slopes


def sink_logits(heads, magnitude, device):
    """Sinks alternating large positive and negative, around `magnitude`."""
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(heads)], device=device)
    return signs * magnitude + torch.randn(heads, device=device)


def make_mods(kind: str, batch: int, heads: int, device) -> Mods:
    """softcap30 / softcap50 / alibi / alibi-batch / sinks / sinks-large / all."""
    if kind.startswith("softcap"):
        return Mods(softcap=float(kind.removeprefix("softcap")))
    if kind.startswith("alibi"):
        return Mods(alibi=alibi_slopes(batch, heads, kind == "alibi-batch", device))
    if kind.startswith("sinks"):
        return Mods(sink=sink_logits(heads, 20.0 if kind == "sinks-large" else 2.0, device))
    assert kind == "all"
    return Mods(softcap=30.0, alibi=alibi_slopes(batch, heads, False, device),
                sink=sink_logits(heads, 2.0, device))


def mod_names(mods: Mods) -> tuple[str, ...]:
    return contract.Score(mods.softcap, mods.alibi is not None, mods.sink is not None).mods


def require_kernels(bundle, dtype, head_dim, mask_kind, mods):
    for direction in ("fwd", "bwd"):
        require_kernel(bundle, dtype, head_dim, mask_kind, direction, mod_names(mods))


def run_case(bundle, size, mask, kind, head_dim, dtype, magnitude=1.0, deterministic=False):
    """fagen's out, lse and gradients (dq, dk, dv[, dsink]) for one call, poisoned first."""
    window, causal = MASKS[mask]
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = size
    torch.manual_seed(seqlen_q * 31 + seqlen_k + head_dim + len(kind) + len(mask))
    mods = make_mods(kind, batch, heads_q, "cuda")
    mask_kind = contract.call_mask(causal, window, seqlen_q, seqlen_k).kind
    require_kernels(bundle, dtype, head_dim, mask_kind, mods)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda") * magnitude
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda") * magnitude
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda")
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    sink = None if mods.sink is None else mods.sink.clone().requires_grad_(True)
    dout = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
    poison_allocator((q.shape, dtype), ((batch, heads_q, seqlen_q), torch.float32))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=mods.softcap,
                               alibi_slopes=mods.alibi, learnable_sink=sink, deterministic=deterministic,
                               return_lse=True, bundle=bundle)
    poison_allocator(*((t.shape, dtype) for t in (q, k, v)))
    inputs = (q, k, v) + (() if sink is None else (sink,))
    grads = torch.autograd.grad(out, inputs, dout)
    torch.cuda.synchronize()
    return q, k, v, dout, out, lse, grads, mods


def check(bundle, size, mask, kind, head_dim=128, dtype=torch.bfloat16, **kwargs):
    q, k, v, dout, out, lse, grads, mods = run_case(bundle, size, mask, kind, head_dim, dtype, **kwargs)
    window, causal = MASKS[mask]
    args = (q.detach(), k.detach(), v.detach())
    failures = forward_failures(out.detach(), lse, *args, causal, None, window, mods)
    failures += gradient_failures(list(grads), *args, dout, causal, None, window, out.detach(), mods)
    assert not failures, f"{kind} {mask} size {size} hd{head_dim}: " + "; ".join(failures)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", ("softcap30", "alibi", "sinks", "all"))
def test_score_matches_reference(bundle, kind, mask, size):
    head_dim = 64 if kind == "sinks" else 128
    check(bundle, size, mask, kind, head_dim)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("kind", ("softcap50", "alibi-batch", "sinks"))
@pytest.mark.parametrize("mask", ("causal", "causal-window"))
def test_score_every_head_dim(bundle, mask, kind, dtype, head_dim):
    check(bundle, (2, 333, 517, 4, 2), mask, kind, head_dim, dtype)


@pytest.mark.parametrize("magnitude", (4.0, 8.0))
@pytest.mark.parametrize("kind", ("softcap30", "softcap50", "alibi", "sinks-large", "all"))
def test_score_large_scores(bundle, kind, magnitude):
    head_dim = 64 if kind.startswith("sinks") else 128
    for mask in ("causal", "causal-window", "full"):
        check(bundle, (2, 300, 500, 2, 2), mask, kind, head_dim, magnitude=magnitude)


def test_softcap_caps_the_scores(bundle):
    """With scores far past the cap, every capped key weighs the same: the output is the mean of
    the values, which a kernel without the cap (or with it applied after the softmax) misses."""
    batch, seqlen, heads, head_dim = 1, 256, 2, 128
    require_kernels(bundle, torch.bfloat16, head_dim, "causal", Mods(softcap=1.0))
    q = torch.ones(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    k = torch.ones(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    v = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = flash_attn_func(q, k, v, causal=True, softcap=1.0, bundle=bundle)
    mean = v.float().cumsum(1) / torch.arange(1, seqlen + 1, device="cuda").view(1, -1, 1, 1)
    assert (out.float() - mean).abs().max().item() < 2e-2


@pytest.mark.parametrize("kind", ("sinks", "all"))
def test_score_deterministic_is_bitwise(bundle, kind):
    size = (2, 1000, 1200, 4, 2)
    head_dim = 64 if kind == "sinks" else 128
    first = run_case(bundle, size, "causal-window", kind, head_dim, torch.bfloat16, deterministic=True)[-2]
    second = run_case(bundle, size, "causal-window", kind, head_dim, torch.bfloat16, deterministic=True)[-2]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    check(bundle, size, "causal-window", kind, head_dim, deterministic=True)


def test_missing_variant_names_its_build_line(bundle):
    """A variant the bundle lacks: the error names the key and the spec entry that builds it."""
    q = torch.randn(1, 16, 2, 72, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelNotFound, match=r"(?s)fwd/bf16/hd72/full\+softcap.*score: softcap"):
        flash_attn_func(q, q, q, softcap=10.0, bundle=bundle)
