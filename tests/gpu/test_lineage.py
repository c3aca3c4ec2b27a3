"""FA1 (the lineage bundle's seeds' algorithm) on the GPU, held to the same numerics rule as the
other kernels. The adapter's selection prefers the newest algorithm, so these tests launch the
bundle's FA1 kernels directly; they skip on a bundle without any (the default bundle).

    FAGEN_BUNDLE=generated/lineage pytest tests/gpu/test_lineage.py
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from test_fa2_fwd import (  # noqa: E402
    DTYPE_BY_NAME, LONG_SIZE, SIZES, assert_close_to_reference, random_qkv, runnable_entries,
)
from fagen.torch.adapter import prepare_launch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def fa1_entry(bundle, dtype_name: str, head_dim: int, causal: bool):
    entries = [e for e in runnable_entries(bundle) if e.fa_version == 1
               and e.key == f"fwd/{dtype_name}/hd{head_dim}/{'causal' if causal else 'full'}"]
    if not entries:
        pytest.skip(f"the bundle has no FA1 kernel for {dtype_name} hd{head_dim} on this device")
    return entries[0]


def run_fa1(bundle, entry, q, k, v, softmax_scale=None):
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.full((batch, seqlen_q, heads_q, head_dim), math.nan, dtype=q.dtype, device="cuda")
    lse = torch.full((batch, heads_q, seqlen_q), math.nan, dtype=torch.float32, device="cuda")
    prepare_launch(bundle, entry, q, k, v, out, lse, softmax_scale)()
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("size", SIZES + (LONG_SIZE,), ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype_name", ("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_fa1_matches_reference(bundle, head_dim, dtype_name, causal, size):
    entry = fa1_entry(bundle, dtype_name, head_dim, causal)
    batch, seqlen_q, seqlen_k = size
    torch.manual_seed(seqlen_q * 7919 + seqlen_k * 31 + head_dim)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 3, 3, head_dim, DTYPE_BY_NAME[dtype_name])
    out, lse = run_fa1(bundle, entry, q, k, v)
    assert_close_to_reference(out, lse, q, k, v, causal)


@pytest.mark.parametrize("heads", ((8, 1), (8, 4)), ids=("mqa8to1", "gqa2to1"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fa1_grouped_query_attention(bundle, causal, heads):
    entry = fa1_entry(bundle, "bf16", 128, causal)
    torch.manual_seed(5)
    q, k, v = random_qkv(2, 300, 257, *heads, 128, torch.bfloat16)
    out, lse = run_fa1(bundle, entry, q, k, v)
    assert_close_to_reference(out, lse, q, k, v, causal)


def test_fa1_strided_inputs_and_scale(bundle):
    entry = fa1_entry(bundle, "fp16", 64, True)
    torch.manual_seed(6)
    q = torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    k = torch.randn(2, 2, 400, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    v = torch.randn(2, 400, 2, 72, device="cuda", dtype=torch.float16)[..., :64]
    out, lse = run_fa1(bundle, entry, q, k, v, softmax_scale=0.3)
    assert_close_to_reference(out, lse, q, k, v, True, scale=0.3)


def test_fa1_workspace_is_state_not_output(bundle):
    # Two calls in a row on one stream reuse freed workspace memory: the second call must not
    # read the first one's state (each query block starts fresh at key block 0).
    entry = fa1_entry(bundle, "bf16", 64, False)
    torch.manual_seed(7)
    first = random_qkv(1, 500, 700, 2, 2, 64, torch.bfloat16)
    second = random_qkv(1, 500, 700, 2, 2, 64, torch.bfloat16)
    run_fa1(bundle, entry, *first)
    out, lse = run_fa1(bundle, entry, *second)
    assert_close_to_reference(out, lse, *second, False)
