"""Calls that once returned a wrong answer without an error (issue 13): gradients, softmax_scale
at and below zero, and the device context a call leaves behind."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from test_fa2_fwd import (  # noqa: E402
    assert_close_to_reference, entry_call, random_qkv, require_kernel, run_poisoned, runnable_entries, value_dim,
)
from fagen.torch import flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_training_step_gets_its_gradients(bundle):
    # A layer whose weight requires grad: once forward-only and silently gradient-free (q, k, v
    # came back without grad_fn); now the projection gets its gradient through fagen's backward.
    require_kernel(bundle, torch.bfloat16, 64, True)
    torch.manual_seed(0)
    projection = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    q, k, v = projection(x).view(2, 100, 3, 4, 64).unbind(dim=2)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is not None
    out.float().pow(2).sum().backward()
    assert projection.weight.grad is not None and torch.isfinite(projection.weight.grad).all()
    assert projection.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("scale", (0.0, 1e-45, 1e-30), ids=("zero", "denormal", "tiny"))
@pytest.mark.parametrize("size", ((2, 300, 300), (2, 300, 128), (1, 1, 1000)), ids=lambda s: "x".join(map(str, s)))
def test_softmax_scale_zero_is_uniform_attention_in_every_kernel(bundle, size, scale):
    # Every kernel (FA2 and FA3, each seqlen-bounded one) launched directly: scale 0 used to give
    # all-NaN output (a masked score, -inf, times 0).
    from fagen.torch.adapter import prepare_launch

    batch, seqlen_q, seqlen_k = size
    for entry in runnable_entries(bundle):
        dtype, head_dim, causal, window, mods, options = entry_call(entry, batch, 4)
        if mods.alibi is not None:
            continue  # ALiBi's bias is in units of the scale: with scale 0 it is not uniform
        torch.manual_seed(seqlen_q + head_dim)
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, value_dim(entry))
        out = torch.full((batch, seqlen_q, 4, value_dim(entry)), math.nan, dtype=dtype, device="cuda")
        lse = torch.full((batch, 4, seqlen_q), math.nan, dtype=torch.float32, device="cuda")
        prepare_launch(bundle, entry, q, k, v, out, lse, scale, window, **options)()
        torch.cuda.synchronize()
        try:
            assert_close_to_reference(out, lse, q, k, v, causal, scale=0.0, window=window, mods=mods)
        except AssertionError as exc:
            raise AssertionError(f"{entry.name}: {exc}") from None


def test_softmax_scale_zero_through_the_public_call(bundle):
    require_kernel(bundle, torch.bfloat16, 128, True)
    torch.manual_seed(3)
    q, k, v = random_qkv(2, 257, 300, 4, 4, 128, torch.bfloat16)
    out, lse = run_poisoned(q, k, v, causal=True, softmax_scale=0)
    assert_close_to_reference(out, lse, q, k, v, True, scale=0.0)
    # Row i sees keys 0 .. i + 43: LSE is the log of that count.
    expected = torch.log(torch.arange(257, device="cuda", dtype=torch.float32) + 44)
    torch.testing.assert_close(lse[0, 0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", (-0.125, math.nan, math.inf))
def test_negative_and_non_finite_scales_are_refused(bundle, scale):
    q, k, v = random_qkv(1, 16, 16, 2, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="softmax_scale="):
        flash_attn_func(q, k, v, softmax_scale=scale)


def _driver():
    from cuda.bindings import driver as cu

    return cu


def _check(result):
    err, *values = result if isinstance(result, tuple) else (result,)
    assert int(err) == 0, f"driver call failed: {err}"
    return values[0] if len(values) == 1 else tuple(values)


def _current_context() -> int:
    return int(_check(_driver().cuCtxGetCurrent()))


def _create_context(ordinal: int):
    """A context of the caller's own on device `ordinal`, made current (as cuCtxCreate does)."""
    cu = _driver()
    device = _check(cu.cuDeviceGet(ordinal))
    try:
        return _check(cu.cuCtxCreate(None, 0, device))  # CUDA 13: (params, flags, device)
    except TypeError:
        return _check(cu.cuCtxCreate(0, device))


def test_a_call_leaves_the_callers_own_context_current(bundle):
    require_kernel(bundle, torch.bfloat16, 64, False)
    torch.manual_seed(4)
    q, k, v = random_qkv(2, 200, 200, 2, 2, 64, torch.bfloat16)
    expected = flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    own = _create_context(torch.cuda.current_device())
    try:
        assert _current_context() == int(own)
        out = flash_attn_func(q, k, v)
        assert _current_context() == int(own), "the call left another context current"
        flash_attn_func(q * 0.5, k, v)  # an unprepared call too (checks, selection, allocation)
        assert _current_context() == int(own), "the call left another context current"
    finally:
        _check(_driver().cuCtxDestroy(own))
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_a_call_on_another_device_leaves_the_current_one(bundle):
    require_kernel(bundle, torch.bfloat16, 64, False)
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # device 0's primary context is current
    before = _current_context()
    q, k, v = random_qkv(2, 200, 200, 2, 2, 64, torch.bfloat16)
    q, k, v = (t.to("cuda:1") for t in (q, k, v))
    out = flash_attn_func(q, k, v)
    assert torch.cuda.current_device() == 0 and _current_context() == before
    assert out.device == torch.device("cuda:1")
    assert torch.empty(4, device="cuda").device == torch.device("cuda:0")
    torch.cuda.synchronize(1)
    assert_close_to_reference(*flash_attn_func(q, k, v, return_lse=True), q, k, v, False)
