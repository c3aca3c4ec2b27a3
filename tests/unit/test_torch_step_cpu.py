"""A training step's attention without a GPU: flash_attn_func's forward and .backward() through
the eager autograd (whose backward is keyed by its forward's kept launch) and through the ops,
on CPU tensors and the fake driver, against the runtime's unprepared calls."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from fagen import abi  # noqa: E402
from fagen.runtime import call as runtime_call  # noqa: E402
from fagen.torch import adapter, backward, flash_attn_func, get_bundle  # noqa: E402

from test_runtime_call import backward_entry, fake, launched  # noqa: E402, F401 (the fixtures)
from test_runtime_cpu import kernel_entry, write_bundle  # noqa: E402  (tests/unit is on sys.path)


@pytest.fixture
def cpu_step(tmp_path, fake, launched, monkeypatch):  # noqa: F811
    """flash_attn_func on CPU tensors (device index None: the fake's device 0) with a bundle of
    FA2 forward and FA3 backward kernels of head dim 64, bf16; returns the bundle's path and the
    lists of forward and backward preparations."""
    device_of = fake.cuDeviceGet
    monkeypatch.setattr(fake, "cuDeviceGet", lambda ordinal: device_of(ordinal or 0))
    for module in (adapter, backward):
        monkeypatch.setattr(module, "_check_device", lambda q, k, v: None)
        monkeypatch.setattr(module, "_current_stream", lambda device: 0)
    monkeypatch.setattr(adapter, "_prepared_launches", {})
    monkeypatch.setattr(backward, "_prepared_backwards", {})
    forwards, backwards = [], []
    prepare_forward, prepare_backward = adapter._prepare, backward.prepare_backward

    def counted_forward(*args, **kwargs):
        forwards.append(args[2:5])
        return prepare_forward(*args, **kwargs)

    def counted_backward(kernels, problem, *args, **kwargs):
        backwards.append(problem)
        return prepare_backward(kernels, problem, *args, **kwargs)

    monkeypatch.setattr(adapter, "_prepare", counted_forward)
    monkeypatch.setattr(backward, "prepare_backward", counted_backward)
    keys = ("bf16/hd64/causal", "bf16/hd64/full", "bf16/hd64/causal+sinks")
    entries = [kernel_entry("sm90", f"fwd/{key}") for key in keys] + [backward_entry(f"bwd/{key}", 3) for key in keys]
    return str(write_bundle(tmp_path / "b", entries)), forwards, backwards


def _inputs(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2):
    q = torch.randn(batch, seqlen_q, heads_q, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v


def _step(q, k, v, dout, bundle, **options):
    """One forward and backward; returns the output."""
    out = flash_attn_func(q, k, v, bundle=bundle, **options)
    out.backward(dout)
    return out


def _contiguous(address: int, like: torch.Tensor) -> runtime_call.Tensor:
    return runtime_call.Tensor.contiguous(address, *like.shape[1:])


def _unprepared_launches(bundle, q, k, v, out, dout, launches, launched, causal=True):  # noqa: F811
    """What the runtime's unprepared calls launch for the forward and backward `launches` (one
    eager step's: their parameters name the outputs, gradients and workspace they wrote)."""
    forward = abi.FwdParams.from_buffer_copy(launches[0][-1][0])
    gradients = abi.BwdParams.from_buffer_copy(launches[2][-1][0])
    kernels = get_bundle(bundle)
    problem = adapter._problem(q, k, v, causal, (-1, -1))
    launched.clear()
    runtime_call.attention(kernels, problem, *(adapter._tensor(t.detach()) for t in (q, k, v)),
                           _contiguous(forward.o, out), forward.lse)
    tensors = runtime_call.BackwardTensors(
        *(adapter._tensor(t.detach()) for t in (q, k, v, out, dout)),
        *(_contiguous(address, t) for address, t in ((gradients.dq, q), (gradients.dk, k), (gradients.dv, v))),
        lse=gradients.lse)
    runtime_call.attention_backward(kernels, problem, tensors, workspace=gradients.dq_accum)
    return list(launched)


@pytest.mark.parametrize("sizes, causal", [((2, 5, 7, 4, 2), True), ((1, 64, 64, 2, 2), False)],
                         ids=["gqa-odd-causal", "mha-full"])
def test_a_repeated_step_launches_as_the_unprepared_calls(cpu_step, launched, sizes, causal):  # noqa: F811
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs(*sizes)
    dout = torch.randn_like(q.detach())
    for _ in range(3):
        launched.clear()
        out = _step(q, k, v, dout, bundle, causal=causal)
    assert len(forwards) == 1 and len(backwards) == 1
    (kept,) = adapter._prepared_launches.values()
    assert len(kept.backwards) == 1 and not backward._prepared_backwards, "keyed by the forward's launch"
    assert len(launched) == 4  # the forward, the backward's three kernels
    assert launched == _unprepared_launches(bundle, q, k, v, out, dout, launched, launched, causal)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_the_ops_launch_as_the_eager_step(cpu_step, launched):  # noqa: F811
    """The traced route (the ops, their registered autograd) and the eager one launch the same
    kernels with the same parameters but for the addresses they allocate."""
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    dout = torch.randn_like(q.detach())
    _step(q, k, v, dout, bundle, causal=True)
    launched.clear()
    out = _step(q, k, v, dout, bundle, causal=True)
    eager = _unprepared_launches(bundle, q, k, v, out, dout, list(launched), launched)
    launched.clear()
    out, lse = adapter.flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, bundle)
    out.backward(dout)
    through_ops = list(launched)
    assert through_ops == _unprepared_launches(bundle, q, k, v, out, dout, through_ops, launched)
    assert [launch[:5] for launch in through_ops] == [launch[:5] for launch in eager]
    assert len(backward._prepared_backwards) == 1  # the op's backward keys by its whole signature


def test_what_the_forward_does_not_fix_prepares_the_backward_anew(cpu_step, launched):  # noqa: F811
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    dout = torch.randn_like(q.detach())
    _step(q, k, v, dout, bundle, causal=True)
    _step(q, k, v, dout.clone(), bundle, causal=True)  # another dout address alone
    assert (len(forwards), len(backwards)) == (1, 1)
    _step(q, k, v, dout, bundle, causal=True, deterministic=True)
    heads_major = dout.transpose(1, 2).contiguous().transpose(1, 2)  # dout's shape, other strides
    _step(q, k, v, heads_major, bundle, causal=True)
    assert (len(forwards), len(backwards)) == (1, 3)
    misaligned = torch.randn(dout.numel() + 1, dtype=dout.dtype)[1:].view(dout.shape)  # 2 bytes past
    for _ in range(2):
        launched.clear()
        _step(q, k, v, misaligned, bundle, causal=True)
        params = abi.BwdParams.from_buffer_copy(launched[2][-1][0])
        assert params.dout != misaligned.data_ptr() and params.dout % 16 == 0, "copied on every call"
    assert (len(forwards), len(backwards)) == (1, 4)
    _step(q, k, v, dout, bundle, causal=False)  # another forward: its backward is its own
    assert (len(forwards), len(backwards)) == (2, 5)


def test_a_forward_that_kept_no_launch_backs_off_to_the_whole_signature(cpu_step, launched):  # noqa: F811
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    misaligned = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).requires_grad_(True)
    dout = torch.randn_like(q.detach())
    for _ in range(2):
        _step(misaligned, k, v, dout, bundle, causal=True)
    assert not adapter._prepared_launches and len(forwards) == 2, "a copied input is not kept"
    assert len(backward._prepared_backwards) == 1 and len(backwards) == 1
    assert misaligned.grad.shape == q.shape


def test_a_sink_gets_its_gradient_through_the_forwards_key(cpu_step, launched):  # noqa: F811
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    sink = torch.randn(4, requires_grad=True)
    for _ in range(2):
        launched.clear()
        _step(q, k, v, torch.randn_like(q.detach()), bundle, causal=True, learnable_sink=sink)
        params = abi.BwdParams.from_buffer_copy(launched[2][-1][0])
        assert params.sinks and params.dsinks and params.dsinks != params.sinks
    assert (len(forwards), len(backwards)) == (1, 1) and not backward._prepared_backwards
    assert sink.grad.shape == sink.shape and sink.grad.dtype == sink.dtype


@pytest.mark.parametrize("options, error, match", [
    (dict(window_size=(-2, 0)), ValueError, "each size must be >= 0, or -1"),
    (dict(window_size=(1.5, 0)), TypeError, "pair of ints"),
    (dict(window_size=(3,)), TypeError, "pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap=-1.0"),
    (dict(softcap=float("nan")), ValueError, "softcap=nan"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a tensor or None"),
    (dict(q_descale=[1.0]), TypeError, "q_descale must be a tensor or None"),
    (dict(causal=1), TypeError, "causal must be True or False"),
])
def test_bad_options_are_refused_after_good_calls(cpu_step, options, error, match):
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    for _ in range(2):
        _step(q, k, v, torch.randn_like(q.detach()), bundle, causal=True)
    with pytest.raises(error, match=match):
        flash_attn_func(q, k, v, bundle=bundle, **{"causal": True, **options})
    assert len(forwards) == 1


def test_bad_tensors_are_refused_after_good_calls(cpu_step):
    bundle, forwards, backwards = cpu_step
    q, k, v = _inputs()
    _step(q, k, v, torch.randn_like(q.detach()), bundle, causal=True)
    _step(q, k, v, torch.randn_like(q.detach()), bundle, causal=True)
    three_heads = [t.detach()[:, :, :1].expand(-1, -1, 3, -1).requires_grad_(True) for t in (k, v)]
    with pytest.raises(ValueError, match="multiple of nheads_kv=3"):
        flash_attn_func(q, *three_heads, causal=True, bundle=bundle)
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_func(q, k.detach().half().requires_grad_(True), v, causal=True, bundle=bundle)
    assert len(forwards) == 1


def test_a_repeated_forward_allocates_what_the_first_did(cpu_step):
    bundle, forwards, backwards = cpu_step
    q = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16).transpose(1, 2)  # (2, 5, 4, 64), heads-major
    k, v = (torch.randn(2, 7, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    first, repeated = (flash_attn_func(q, k, v, causal=True, bundle=bundle, return_lse=True) for _ in range(2))
    assert len(forwards) == 1
    for made, again in zip(first, repeated):
        assert (again.shape, again.dtype, again.device, again.stride()) == (
            made.shape, made.dtype, made.device, made.stride())
    assert first[0].shape == (2, 5, 4, 64) and first[1].shape == (2, 4, 5)


def test_a_given_bundle_path_does_not_depend_on_the_environment(monkeypatch):
    monkeypatch.setenv("FAGEN_BUNDLE", "/one")
    given, default = adapter._bundle_request("/b"), adapter._bundle_request(None)
    monkeypatch.setenv("FAGEN_BUNDLE", "/two")
    assert adapter._bundle_request("/b") == given and adapter._bundle_request(None) != default
    monkeypatch.delenv("FAGEN_BUNDLE")
    monkeypatch.setenv("FAGEN_HOME", "/home")
    assert adapter._bundle_request(None) == (None, None, "/home")


def test_an_op_called_eagerly_in_a_compiled_region_is_not_traced(cpu_step, monkeypatch):
    """The ops' kernels run with dynamo off, as torch.library.custom_op's do: dynamo would
    otherwise compile fagen's own functions, frame by frame, when an op runs outside a graph."""
    bundle, forwards, backwards = cpu_step
    q, k, v = (t.detach() for t in _inputs())
    traced, signature = [], adapter._call_signature

    def probed(*args):  # is_compiling() is True where dynamo traces the frame that asks
        traced.append(torch.compiler.is_compiling())
        return signature(*args)

    monkeypatch.setattr(adapter, "_call_signature", probed)

    @torch.compiler.disable(recursive=False)
    def eager_region(q, k, v):
        return adapter.flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, bundle)[0]

    @torch.compile(backend="eager")
    def compiled(q, k, v):
        return eager_region(q, k, v) * 2

    compiled(q, k, v)
    assert traced == [False] and len(forwards) == 1


def test_importing_the_adapter_does_not_import_dynamo():
    """The ops' kernels turn dynamo off at their first call: importing torch._dynamo (seconds)
    would otherwise be part of `import fagen.torch`."""
    code = "import sys, fagen.torch; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
