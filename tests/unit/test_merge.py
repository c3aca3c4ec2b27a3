"""merge_attention_states on the CPU: two attentions over disjoint key sets merge into the
attention over their union (fp32 reference), dense and packed layouts, rows that saw no key in
one or both halves, and its shape checks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fagen.torch import merge_attention_states  # noqa: E402


def attention(q, k, v):
    """(out, lse) of (tokens, heads, d) tensors with a leading batch; lse (batch, heads, tokens)."""
    scores = torch.einsum("bshd,bkhd->bhsk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhsk,bkhd->bshd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("split", [1, 5, 10])
@pytest.mark.parametrize("magnitude", [1.0, 8.0])
def test_merge_equals_union(split, magnitude):
    gen = torch.Generator().manual_seed(split)
    q, k, v = (torch.randn(2, 6, 3, 16, generator=gen) * magnitude for _ in range(3))
    k, v = torch.randn(2, 11, 3, 16, generator=gen) * magnitude, torch.randn(2, 11, 3, 16, generator=gen)
    out_a, lse_a = attention(q, k[:, :split], v[:, :split])
    out_b, lse_b = attention(q, k[:, split:], v[:, split:])
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = attention(q, k, v)
    assert (out - want_out).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-4 * magnitude ** 2
    # packed: (total, heads, d) with lse (heads, total)
    packed, packed_lse = merge_attention_states(out_a[0], lse_a[0], out_b[0], lse_b[0])
    assert torch.equal(packed, out[0]) and torch.equal(packed_lse, lse[0])


def test_rows_without_keys():
    out_a, out_b = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    lse_a = torch.randn(2, 4)
    empty = torch.full((2, 4), -math.inf)
    out, lse = merge_attention_states(out_a, lse_a, out_b, empty)
    assert torch.allclose(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge_attention_states(out_a, empty, out_b, empty)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == -math.inf).all()
    assert torch.isfinite(out).all()


def test_bf16_output_keeps_dtype():
    out, lse = merge_attention_states(*(t for t in (torch.randn(3, 2, 8).bfloat16(), torch.randn(2, 3),
                                                    torch.randn(3, 2, 8).bfloat16(), torch.randn(2, 3))))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_shape_checks():
    with pytest.raises(ValueError, match="one shape"):
        merge_attention_states(torch.zeros(3, 2, 8), torch.zeros(2, 3), torch.zeros(4, 2, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="nheads, tokens"):
        merge_attention_states(torch.zeros(3, 2, 8), torch.zeros(3, 2), torch.zeros(3, 2, 8), torch.zeros(3, 2))
