"""A custom mask compiled in ahead of time, on the GPU: fagen's worked example
(examples/masks/document.cuh, a document mask for packed sequences: causal within each document)
forward and backward against an fp64 reference with the same mask under attention_reference's
rule (2x torch's bf16 error forward, 3x for the gradients), documents of 1 to thousands of
tokens, GQA, odd lengths; and the refusals. Skips what the bundle under test lacks
(tests/gpu/score_variants.yaml builds the example's kernels)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attention_reference import REFERENCE, failures_of, max_error  # noqa: E402
from test_fa2_fwd import poison_allocator, require_kernel  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.runtime import KernelNotFound, runs_on  # noqa: E402
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def document_ids(batch: int, seqlen: int, lengths: tuple[int, ...], seed: int) -> torch.Tensor:
    """int32 (batch, seqlen): each row packs documents of the given lengths (cycled, shuffled per
    row), the last cut at seqlen."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        order = torch.randperm(len(lengths), generator=generator).tolist()
        ids, doc = [], 0
        while len(ids) < seqlen:
            ids.extend([doc] * lengths[order[doc % len(order)]])
            doc += 1
        rows.append(ids[:seqlen])
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def visible(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seqlen, seqlen): query i sees key j of its own document, j <= i."""
    same = documents[:, :, None] == documents[:, None, :]
    seqlen = documents.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=documents.device).tril()
    return (same & causal)[:, None]


def masked_attention(q, k, v, see, scale, dtype):
    """Explicit softmax attention in `dtype` under the boolean mask: out (b, s, h, dv), lse."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kh, vh = (t.repeat_interleave(group, dim=1) for t in (kh, vh))
    scores = ((qh @ kh.transpose(-1, -2)) * scale).masked_fill(~see, -math.inf)
    return (torch.softmax(scores, -1) @ vh).transpose(1, 2), torch.logsumexp(scores, -1)


def reference_grads(q, k, v, dout, see, scale, dtype):
    inputs = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = masked_attention(*inputs, see, scale, dtype)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), [t.grad for t in inputs]


# (batch, seqlen, heads_q, heads_kv, document lengths)
CASES = ((1, 257, 2, 2, (257,)), (2, 1000, 4, 2, (1, 7, 100, 300)), (2, 2048, 4, 1, (512, 64, 1, 1000)),
         (1, 3001, 2, 2, (129, 128, 127, 2000)))


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}s{c[1]}h{c[2]}-{c[3]}")
def test_document_mask_matches_reference(bundle, case, head_dim):
    batch, seqlen, heads_q, heads_kv, lengths = case
    for direction in ("fwd", "bwd"):
        require_kernel(bundle, torch.bfloat16, head_dim, "document", direction)
    torch.manual_seed(seqlen + head_dim)
    documents = document_ids(batch, seqlen, lengths, seed=seqlen)
    q = torch.randn(batch, seqlen, heads_q, head_dim, device="cuda").bfloat16().requires_grad_(True)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda").bfloat16().requires_grad_(True)
            for _ in range(2))
    dout = torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=torch.bfloat16)
    poison_allocator(((batch, seqlen, heads_q, head_dim), torch.bfloat16), ((batch, heads_q, seqlen), torch.float32))
    out, lse = flash_attn_func(q, k, v, mask_mod="document", mask_args=documents, return_lse=True,
                               bundle=bundle)
    poison_allocator(*((t.shape, torch.bfloat16) for t in (q, k, v)))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    see, scale = visible(documents), 1 / math.sqrt(head_dim)
    _, _, ref_grads = reference_grads(q, k, v, dout, see, scale, REFERENCE)
    _, _, low_grads = reference_grads(q, k, v, dout, see, scale, torch.bfloat16)
    errors = forward_errors(out.detach(), lse, q.detach(), k.detach(), v.detach(), see, scale)
    for name, g, r, lo, t in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, (q, k, v)):
        assert g.shape == t.shape and torch.isfinite(g).all(), name
        errors[name] = (max_error(g, r), max_error(lo, r), max_error(r.to(t.dtype), r))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    failures = failures_of(errors)
    assert not failures, "; ".join(failures)


def forward_errors(out, lse, q, k, v, see, scale):
    ref_out, ref_lse = masked_attention(q, k, v, see, scale, REFERENCE)
    low_out, low_lse = masked_attention(q, k, v, see, scale, q.dtype)
    return {"out": (max_error(out, ref_out), max_error(low_out, ref_out), max_error(ref_out.to(q.dtype), ref_out)),
            "lse": (max_error(lse, ref_lse), max_error(low_lse, ref_lse), 0.0)}


def test_every_document_kernel_of_the_bundle(bundle):
    """Each forward kernel of the custom mask launched directly (the FA2 ones too, which the
    selection passes over on Hopper for FA3's)."""
    from fagen.torch.adapter import prepare_launch

    cc = torch.cuda.get_device_capability()
    entries = [e for e in bundle.kernels if runs_on(e, cc)
               and (key := contract.KernelKey.parse(e.key)).mask == "document" and key.direction == "fwd"]
    if not entries:
        pytest.skip("the bundle has no document-mask forward kernel for this device")
    batch, seqlen, heads = 2, 1500, 3
    documents = document_ids(batch, seqlen, (1, 33, 400, 900), seed=1)
    for entry in entries:
        head_dim = contract.KernelKey.parse(entry.key).head_dim
        torch.manual_seed(head_dim)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.full_like(q, math.nan)
        lse = torch.full((batch, heads, seqlen), math.nan, device="cuda")
        prepare_launch(bundle, entry, q, k, v, out, lse, mask_args=documents)()
        torch.cuda.synchronize()
        failures = failures_of(forward_errors(out, lse, q, k, v, visible(documents), 1 / math.sqrt(head_dim)))
        assert not failures, f"{entry.name}: " + "; ".join(failures)


def test_one_document_is_the_causal_mask(bundle):
    """A row of one document is plain causal attention: the same answer as the causal kernel."""
    require_kernel(bundle, torch.bfloat16, 128, "document")
    require_kernel(bundle, torch.bfloat16, 128, "causal")
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    documents = torch.zeros(2, 700, dtype=torch.int32, device="cuda")
    ours = flash_attn_func(q, k, v, mask_mod="document", mask_args=documents, bundle=bundle)
    causal = flash_attn_func(q, k, v, causal=True, bundle=bundle)
    assert (ours.float() - causal.float()).abs().max().item() < 2e-2


def test_custom_mask_refusals(bundle):
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    documents = torch.zeros(1, 64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="replaces causal and window_size"):
        flash_attn_func(q, q, q, causal=True, mask_mod="document", mask_args=documents, bundle=bundle)
    with pytest.raises(NotImplementedError, match="deterministic=True takes the built-in masks"):
        flash_attn_func(q, q, q, mask_mod="document", mask_args=documents, deterministic=True, bundle=bundle)
    with pytest.raises(KernelNotFound, match=r"fwd/bf16/hd64/prefix_lm"):
        flash_attn_func(q, q, q, mask_mod="prefix_lm", mask_args=documents, bundle=bundle)
