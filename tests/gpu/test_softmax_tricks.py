"""FA4's two softmax options (exp2 emulation, conditional rescale) run on Hopper inside FA2
kernels (no Blackwell GPU here): every such kernel of the bundle under test against the fp32
reference. Skips on a bundle without them; tests/gpu/softmax_tricks.yaml builds one."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from test_fa2_fwd import (  # noqa: E402
    DTYPE_BY_NAME, SIZES, assert_close_to_reference, random_qkv, runnable_entries,
)
from fagen.torch.adapter import prepare_launch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def trick_entries(bundle):
    tricks = ("exp2_emulation", "rescale_threshold")
    entries = [e for e in runnable_entries(bundle) if any(t in e.spec["tile"] for t in tricks)]
    if not entries:
        pytest.skip("the bundle has no kernel with exp2_emulation or rescale_threshold")
    return entries


@pytest.mark.parametrize("size", SIZES + ((2, 2000, 2000),), ids=lambda s: "x".join(map(str, s)))
def test_softmax_options_match_reference(bundle, size):
    batch, seqlen_q, seqlen_k = size
    for entry in trick_entries(bundle):
        _, dtype_name, head_dim, mask = entry.key.split("/")
        head_dim, causal = int(head_dim[2:]), mask == "causal"
        torch.manual_seed(seqlen_q + head_dim)
        # Scores spread wide enough that the row maximum grows past the threshold of 8 (base 2).
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 2, 2, head_dim, DTYPE_BY_NAME[dtype_name])
        q = q * 4
        out = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
        lse = torch.full((batch, 2, seqlen_q), math.nan, dtype=torch.float32, device="cuda")
        prepare_launch(bundle, entry, q, k, v, out, lse)()
        torch.cuda.synchronize()
        try:
            assert_close_to_reference(out, lse, q, k, v, causal)
        except AssertionError as exc:
            raise AssertionError(f"{entry.name}: {exc}") from None
