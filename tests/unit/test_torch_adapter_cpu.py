"""The torch adapter without a GPU: validation, stride handling, fake impl, torch.compile trace."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from fagen import abi  # noqa: E402
from fagen.torch import adapter, backward, bundle_path, flash_attn_func, get_bundle, kernel_key  # noqa: E402

from test_runtime_call import backward_entry, fake, launched  # noqa: E402, F401 (the fixtures)
from test_runtime_cpu import KEY, kernel_entry, write_bundle  # noqa: E402  (tests/unit is on sys.path)


def _qkv(batch=2, seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.bfloat16):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_kernel_key():
    assert kernel_key(torch.bfloat16, 128, "causal") == "fwd/bf16/hd128/causal"
    assert kernel_key(torch.float16, 64, "full") == "fwd/fp16/hd64/full"
    assert kernel_key(torch.float16, 64, "local") == "fwd/fp16/hd64/local"


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, "float32"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q[0], k, v), ValueError, "must be 4-D"),
        (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)),
         ValueError, "multiple of nheads_kv=3"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "agree on batch"),
        (lambda q, k, v: (q, k, v[:, :3]), ValueError, "k and v must agree on"),
        (lambda q, k, v: (q, k, v[..., :60]), ValueError, "head_dim_v=60"),
        (lambda q, k, v: (q[..., :60], k[..., :60], v[..., :60]), ValueError, "head_dim=60"),
        (lambda q, k, v: (q, k, v), ValueError, "CUDA tensors"),
    ],
)
def test_bad_input_is_rejected_before_launch(change, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*change(*_qkv()))


@pytest.mark.parametrize("options, error, match", [
    ({"mask_mod": "document", "causal": True}, ValueError, "replaces causal and window_size"),
    ({"mask_mod": "document", "window_size": (8, 0)}, ValueError, "replaces causal and window_size"),
    ({"mask_mod": "Document"}, ValueError, "lower-case letters"),
    ({"mask_mod": 3}, TypeError, "custom mask's name"),
    ({"mask_args": torch.zeros(4)}, ValueError, "mask_args without mask_mod"),
    ({"mask_mod": "document", "deterministic": True}, NotImplementedError, "built-in masks"),
])
def test_a_bad_custom_mask_call_is_rejected_before_launch(options, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*_qkv(), **options)


def test_strides_used_as_is_for_a_transposed_view():
    t = torch.randn(2, 4, 9, 64, dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d) view
    assert adapter._kernel_strides(t) == (4 * 9 * 64, 64, 9 * 64)
    assert adapter._kernel_ready(t) is t


def test_broadcast_kv_is_used_as_is():
    t = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16).expand(3, -1, 2, -1)
    assert adapter._kernel_strides(t) == (0, 64, 0)


def test_size_one_dims_never_force_a_copy():
    t = torch.randn(1, 1, 3, 64, dtype=torch.bfloat16)
    odd = t.as_strided(t.shape, (7, 5, 64, 1))
    assert adapter._kernel_strides(odd) == (3 * 64, 3 * 64, 64)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 9, 3, 128, dtype=torch.bfloat16)[..., ::2],  # last dim strided
        lambda: torch.randn(2 * 9 * 3 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 9, 3, 64),  # 2-byte offset
        lambda: torch.randn(2, 9, 3, 72, dtype=torch.bfloat16)[..., :64],  # row stride 216: fine
        lambda: torch.randn(2, 9, 3, 68, dtype=torch.float16)[..., :64],  # row stride 204: copy
    ],
)
def test_unusable_layouts_are_copied(make):
    t = make()
    ready = adapter._kernel_ready(t)
    assert torch.equal(ready, t)
    assert ready.stride(3) == 1 and ready.data_ptr() % 16 == 0
    assert all(s % 8 == 0 for s in adapter._kernel_strides(ready))
    if adapter._kernel_strides(t) is None:
        assert ready.is_contiguous() and ready.data_ptr() != t.data_ptr()
    else:
        assert ready is t


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = _qkv(seqlen_q=5, seqlen_k=11, heads_q=8, heads_kv=1, head_dim=96)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 5, 8, 96) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 5) and lse.dtype == torch.float32


def _compiled_graphs(attention) -> list:
    """The graphs a fullgraph torch.compile of `attention` traces on CPU inputs (whose run the
    adapter then refuses: no CUDA tensors)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with pytest.raises(ValueError, match="CUDA tensors"):  # traced fine; the CPU run is refused
        torch.compile(attention, fullgraph=True, backend=capture)(*_qkv())
    return graphs


def test_torch_compile_traces_one_graph_with_the_op():
    graphs = _compiled_graphs(lambda q, k, v: flash_attn_func(q, k, v, causal=True, softmax_scale=0.5) * 2)
    assert len(graphs) == 1
    assert "torch.ops.fagen.flash_attn_fwd.default" in graphs[0].code


def test_torch_compile_takes_a_loaded_bundle(tmp_path):
    """bundle= a loaded Bundle inside a fullgraph compile: its registration's lock is not traced
    (that was a graph break); the op carries its path."""
    loaded = get_bundle(write_bundle(tmp_path / "b", [kernel_entry("sm90", KEY)]))
    graphs = _compiled_graphs(lambda q, k, v: flash_attn_func(q, k, v, causal=True, bundle=loaded))
    assert len(graphs) == 1 and str(loaded.path) in graphs[0].code


def test_bundle_lookup_order_and_cache(tmp_path, monkeypatch):
    explicit = write_bundle(tmp_path / "explicit", [kernel_entry("sm90", KEY)])
    from_env = write_bundle(tmp_path / "env", [kernel_entry("sm90", KEY)])
    monkeypatch.setenv("FAGEN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FAGEN_BUNDLE", raising=False)
    assert bundle_path() == (tmp_path / "home" / "default").resolve()
    monkeypatch.setenv("FAGEN_BUNDLE", str(from_env))
    assert bundle_path() == from_env.resolve()
    assert bundle_path(explicit) == explicit.resolve()
    first = get_bundle(explicit)
    assert get_bundle(str(explicit)) is first
    assert get_bundle(first) is first
    assert get_bundle().path == from_env.resolve()


def test_tensors_reach_the_runtime_with_their_kernel_strides():
    q = torch.randn(2, 4, 33, 64, dtype=torch.float16).transpose(1, 2)  # (2, 33, 4, 64) view
    k = torch.randn(2, 50, 1, 64, dtype=torch.float16)
    assert adapter._tensor(q) == adapter.runtime_call.Tensor(q.data_ptr(), 4 * 33 * 64, 64, 33 * 64)
    assert adapter._problem(q, k, k, True, (-1, -1)) == adapter.runtime_call.Problem(
        "fp16", True, 2, 33, 50, 4, 1, 64)
    assert adapter._problem(q, k, k, False, (8, 0)).window_size == (8, 0)
    v = torch.randn(2, 50, 1, 32, dtype=torch.float16)
    problem = adapter._problem(q, k, v, True, (-1, -1))
    assert (problem.head_dim_v, problem.value_dim, problem.key) == (32, 32, "fwd/fp16/hd64v32/causal")


def test_broadcast_is_copied_for_tma_kernels():
    t = torch.randn(1, 9, 2, 64, dtype=torch.bfloat16).expand(3, -1, -1, -1)
    assert adapter._kernel_ready(t) is t
    ready = adapter._kernel_ready(t, uses_tma=True)
    assert ready is not t and ready.is_contiguous() and torch.equal(ready, t)


def _without_device(monkeypatch, prepared_inputs):
    """Runs _flash_attn_fwd on CPU tensors: the device check, kernel choice, preparation and
    launch are replaced; returns the list of preparations and the list of launches."""
    preparations, launches = [], []

    def prepare(kernels, entry, q, k, v, out, causal, window, softmax_scale, *score_modifiers):
        preparations.append((q, k, v))
        return adapter._PreparedLaunch(FakePrepared(), prepared_inputs(q, k, v))

    class FakePrepared:
        device = 0

    monkeypatch.setattr(adapter, "_prepared_launches", {})
    monkeypatch.setattr(adapter, "get_bundle", lambda bundle: object())
    monkeypatch.setattr(adapter, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(adapter.runtime_call, "select", lambda kernels, problem, device: object())
    monkeypatch.setattr(adapter, "_prepare", prepare)
    monkeypatch.setattr(adapter, "_launch", lambda prepared, out, lse: launches.append(prepared))
    monkeypatch.setattr(adapter.driver, "primary_context", lambda device: contextlib.nullcontext())
    return preparations, launches


def test_a_repeated_call_reuses_its_prepared_launch(monkeypatch):
    preparations, launches = _without_device(monkeypatch, lambda q, k, v: (q, k, v))
    q, k, v = _qkv()
    for _ in range(3):
        adapter._flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, None)
    assert len(preparations) == 1 and len(launches) == 3
    adapter._flash_attn_fwd(q, k, v, None, None, False, -1, -1, 0.0, None, None)  # another mask: prepared anew
    adapter._flash_attn_fwd(q, k, v, None, None, True, 3, -1, 0.0, None, None)  # another window: prepared anew
    adapter._flash_attn_fwd(q.clone(), k, v, None, None, True, -1, -1, 0.0, None, None)  # another address: prepared anew
    assert len(preparations) == 4
    kept = list(adapter._prepared_launches.values())
    assert kept and all(p.inputs == () for p in kept), "a kept launch must not hold the inputs"


def test_a_call_that_copied_its_inputs_is_not_kept(monkeypatch):
    preparations, launches = _without_device(monkeypatch, lambda q, k, v: (q.clone(), k, v))
    q, k, v = _qkv()
    adapter._flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, None)
    adapter._flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, None)
    assert len(preparations) == 2 and not adapter._prepared_launches


# ---- calls that would give a wrong answer are refused (before any device check or launch) ----

def test_extra_positional_arguments_are_refused():
    # flash-attn's 4th positional argument is dropout_p: flash_attn_func(q, k, v, 0.1) must not
    # become causal=0.1.
    with pytest.raises(TypeError, match="takes q, k and v positionally and everything else by "
                                        "keyword.*4th positional argument is dropout_p"):
        flash_attn_func(*_qkv(), 0.1)


@pytest.mark.parametrize("causal", (0.1, 1, 0, "yes", None))
def test_causal_must_be_a_bool(causal):
    with pytest.raises(TypeError, match=f"causal must be True or False, got {causal!r}"):
        flash_attn_func(*_qkv(), causal=causal)


@pytest.mark.parametrize("name, value", [("dropout_p", 0.1), ("return_attn_probs", True)])
def test_unsupported_flash_attn_options_are_refused(name, value):
    with pytest.raises(NotImplementedError, match=f"{name}=.* is not supported"):
        flash_attn_func(*_qkv(), **{name: value})


@pytest.mark.parametrize("name, value", [
    ("dropout_p", 0.0), ("dropout_p", 0), ("window_size", (-1, -1)), ("window_size", [-1, -1]),
    ("softcap", 0.0), ("alibi_slopes", None), ("learnable_sink", None), ("return_attn_probs", False),
])
def test_flash_attn_options_at_their_off_value_change_nothing(name, value):
    with pytest.raises(ValueError, match="CUDA tensors"):  # got as far as the device check
        flash_attn_func(*_qkv(), **{name: value})


@pytest.mark.parametrize("options", [
    {"softcap": 30.0}, {"alibi_slopes": torch.ones(4)}, {"alibi_slopes": torch.ones(2, 4)},
    {"learnable_sink": torch.zeros(4)}, {"softcap": 50, "learnable_sink": torch.zeros(4, dtype=torch.bfloat16)},
])
def test_score_modifiers_get_as_far_as_the_device_check(options):
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(*_qkv(), **options)


@pytest.mark.parametrize("options, error, match", [
    ({"softcap": -1.0}, ValueError, "softcap=-1.0: must be a finite number >= 0"),
    ({"softcap": float("nan")}, ValueError, "softcap=nan"), ({"softcap": True}, TypeError, "softcap must be a number"),
    ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must be float of shape \(nheads,\) = \(4,\)"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.int32)}, ValueError, "alibi_slopes must be float"),
    ({"learnable_sink": torch.zeros(2, 4)}, ValueError, r"learnable_sink must be float of shape \(nheads,\)"),
    ({"learnable_sink": [0.0] * 4}, TypeError, "learnable_sink must be a tensor or None"),
])
def test_malformed_score_modifiers_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*_qkv(), **options)


@pytest.mark.parametrize("window, error, match", [
    ((1, 2, 3), TypeError, "window_size must be a pair of ints"), ((1.5, 0), TypeError, "pair of ints"),
    ((True, 0), TypeError, "pair of ints"), ((-2, 0), ValueError, r"each size must be >= 0, or -1"),
])
def test_malformed_window_is_refused(window, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*_qkv(), window_size=window)


@pytest.mark.parametrize("window", [(128, 0), (0, 0), (3, 7), (-1, 4)])
def test_a_window_gets_as_far_as_the_device_check(window):
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_func(*_qkv(), window_size=window)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        flash_attn_func(*_qkv(), casual=True)


@pytest.mark.parametrize("scale, match", [
    (-0.125, r"softmax_scale=-0.125: must be >= 0 .*pass -q and softmax_scale=\|scale\|"),
    (float("nan"), "softmax_scale=nan: must be a finite number"),
    (float("inf"), "softmax_scale=inf: must be a finite number"),
    (-float("inf"), "softmax_scale=-inf: must be a finite number"),
    (1e39, r"softmax_scale \* log2\(e\) overflows float32"),
])
def test_bad_softmax_scale_is_refused(scale, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_func(*_qkv(), softmax_scale=scale)


def test_softmax_scale_zero_and_tiny_launch_with_the_smallest_normal_scale():
    from fagen.contract import MIN_SCALE_LOG2, kernel_scale_log2

    assert kernel_scale_log2(0.0, 64) == MIN_SCALE_LOG2 == 2.0 ** -126
    assert kernel_scale_log2(1e-45, 64) == MIN_SCALE_LOG2
    assert kernel_scale_log2(None, 64) == 0.125 * 1.4426950408889634


def test_softmax_scale_must_be_a_number():
    with pytest.raises(TypeError, match="softmax_scale must be a number or None"):
        flash_attn_func(*_qkv(), softmax_scale="0.1")


@pytest.mark.parametrize("deterministic", (1, None, "yes"))
def test_deterministic_must_be_a_bool(deterministic):
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flash_attn_func(*_qkv(), deterministic=deterministic)


@pytest.mark.parametrize("module, attribute, name", [
    ("adapter", "flash_attn_fwd", "flash_attn_fwd"), ("adapter", "flash_attn_fwd_fp8", "flash_attn_fwd_fp8"),
    ("backward", "flash_attn_bwd", "flash_attn_bwd"), ("varlen", "flash_attn_varlen_fwd", "flash_attn_varlen_fwd"),
    ("varlen", "flash_attn_varlen_bwd", "flash_attn_varlen_bwd"),
    ("kvcache", "flash_attn_kvcache", "flash_attn_kvcache"),
    ("kvcache", "flash_attn_kvcache_append", "flash_attn_kvcache_append"),
    ("merge", "merge_states", "merge_attention_states"),
])
def test_every_op_is_a_plain_operator_of_the_fagen_namespace(module, attribute, name):
    # define_op's torch.library.define/impl ops, not custom_op's (whose Python wrappers cost
    # each call 10-40 us of host time).
    import importlib

    op = getattr(importlib.import_module(f"fagen.torch.{module}"), attribute)
    assert type(op) is torch._ops.OpOverload
    assert op.namespace == "fagen" and op is getattr(torch.ops.fagen, name).default


def test_the_appending_op_declares_and_bumps_the_caches_it_writes():
    schema = torch.ops.fagen.flash_attn_kvcache_append.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == \
        ["k_cache", "v_cache"]

    def write(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a write autograd does not see
        a.numpy()[:] = 1
        return b

    a, b = torch.zeros(2), torch.zeros(2)
    adapter._dynamo_disabled(write, ("a",))(a, b)
    assert (a._version, b._version) == (1, 0) and a.tolist() == [1, 1]


@pytest.mark.parametrize("which", ("q", "k", "v"))
def test_the_ops_record_a_backward_that_returns_gradients_of_the_inputs_shapes(which):
    # The custom ops' fake implementations stand in for the kernels: a call whose inputs
    # require grad records fagen::flash_attn_bwd, and backward() gives each input that needs
    # it a gradient of its shape (GQA: dk, dv with the K/V heads), the others none.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = _qkv(heads_q=8, heads_kv=2)
        dict(q=q, k=k, v=v)[which].requires_grad_(True)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert out.requires_grad and not lse.requires_grad  # the LSE is not differentiable
        out.float().sum().backward()
        for name, t in (("q", q), ("k", k), ("v", v)):
            if name == which:
                assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
            else:
                assert t.grad is None


def test_a_traced_training_step_goes_through_both_ops():
    # fullgraph tracing of forward and backward succeeds (a graph break would raise Unsupported);
    # only running the traced graph on CPU tensors is refused.
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True).float().sum()

    q, k, v = (t.requires_grad_(True) for t in _qkv())
    with pytest.raises(Exception, match="CUDA tensors"):  # traced fine; the CPU run is refused
        step(q, k, v).backward()


# ---- the backward's prepared launches, on CPU tensors through the fake driver ----

@pytest.fixture
def cpu_backward(tmp_path, fake, launched, monkeypatch):  # noqa: F811
    """_flash_attn_bwd on CPU tensors (device index None: the fake's device 0) with a bundle of
    FA3 backward kernels of head dim 64; returns the bundle's path and the list of problems
    prepared."""
    device_of = fake.cuDeviceGet
    monkeypatch.setattr(fake, "cuDeviceGet", lambda ordinal: device_of(ordinal or 0))
    monkeypatch.setattr(backward, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(backward, "_current_stream", lambda device: 0)
    monkeypatch.setattr(backward, "_prepared_backwards", {})
    preparations, prepare = [], backward.prepare_backward

    def counted(kernels, problem, *args, **kwargs):
        preparations.append(problem)
        return prepare(kernels, problem, *args, **kwargs)

    monkeypatch.setattr(backward, "prepare_backward", counted)
    keys = ("bf16/hd64/causal", "bf16/hd64/full", "bf16/hd64/local", "bf16/hd64/causal+softcap", "fp16/hd64/causal")
    return str(write_bundle(tmp_path / "b", [backward_entry(f"bwd/{key}", 3) for key in keys])), preparations


def _gradients(dout, q, k, v, out, bundle, causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None,
               deterministic=False):
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    return backward._flash_attn_bwd(dout, q, k, v, out, lse, None, None, causal, *window, softcap, softmax_scale,
                                    bundle, deterministic)


@pytest.mark.parametrize("sizes, causal", [((2, 5, 7, 4, 2), True), ((1, 64, 64, 2, 2), False),
                                           ((3, 33, 129, 8, 1), True)], ids=["gqa-odd", "mha-full", "mqa-odd"])
def test_a_repeated_backward_launches_as_the_unprepared_call(cpu_backward, launched, sizes, causal):  # noqa: F811
    bundle, preparations = cpu_backward
    q, k, v = _qkv(*sizes)
    out, dout = torch.randn_like(q), torch.randn_like(q).transpose(1, 2).contiguous().transpose(1, 2)
    _gradients(dout, q, k, v, out, bundle, causal, softmax_scale=0.1)
    q = q.clone()  # another address, the same signature
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    launched.clear()
    dq, dk, dv, _ = backward._flash_attn_bwd(dout, q, k, v, out, lse, None, None, causal, -1, -1, 0.0, 0.1, bundle,
                                             False)
    assert len(preparations) == 1 and len(launched) == 3
    prepared = list(launched)
    params = abi.BwdParams.from_buffer_copy(prepared[1][-1][0])
    assert (params.q, params.dq, params.lse) == (q.data_ptr(), dq.data_ptr(), lse.data_ptr())
    launched.clear()
    tensors = adapter.runtime_call.BackwardTensors(
        *(adapter._tensor(t) for t in (q, k, v, out, dout, dq, dk, dv)), lse=lse.data_ptr())
    adapter.runtime_call.attention_backward(get_bundle(bundle), adapter._problem(q, k, v, causal, (-1, -1)), tensors,
                                            workspace=params.dq_accum, softmax_scale=0.1)
    assert launched == prepared


def test_a_changed_signature_prepares_anew(cpu_backward):
    bundle, preparations = cpu_backward
    q, k, v = _qkv()
    _gradients(q, q, k, v, q, bundle)
    _gradients(q.clone(), q.clone(), k.clone(), v.clone(), q.clone(), bundle)  # new addresses alone
    assert len(preparations) == 1
    heads_major = k.transpose(1, 2).contiguous().transpose(1, 2)  # k's shape, other strides
    longer = _qkv(seqlen_q=6)[0]
    halves = [t.half() for t in (q, k, v)]
    for change in (dict(causal=False), dict(window=(3, 0)), dict(softcap=5.0), dict(softmax_scale=0.2),
                   dict(deterministic=True), dict(k=heads_major), dict(q=longer, dout=longer, out=longer),
                   dict(q=halves[0], k=halves[1], v=halves[2], dout=halves[0], out=halves[0])):
        arguments = {"dout": q, "q": q, "k": k, "v": v, "out": q, **change}
        _gradients(arguments.pop("dout"), arguments.pop("q"), arguments.pop("k"), arguments.pop("v"),
                   arguments.pop("out"), bundle, **arguments)
    assert len(preparations) == 9
    assert [p.mask.kind for p in preparations[1:3]] == ["full", "local"] and preparations[-1].dtype == "fp16"


def test_inputs_a_kernel_cannot_read_are_copied_on_every_call(cpu_backward, launched):  # noqa: F811
    bundle, preparations = cpu_backward
    q, k, v = _qkv()
    misaligned = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # 2 bytes past an alignment
    broadcast = k[:1].expand(2, -1, -1, -1)  # stride 0, which a TMA map cannot take
    for _ in range(2):
        launched.clear()
        _gradients(q, misaligned, broadcast, v, q, bundle)
        params = abi.BwdParams.from_buffer_copy(launched[1][-1][0])
        assert params.q != misaligned.data_ptr() and params.q % 16 == 0
        assert params.k != broadcast.data_ptr() and params.k_batch_stride == 7 * 2 * 64
    assert len(preparations) == 1


def test_a_bad_backward_is_refused_after_good_ones(cpu_backward):
    bundle, preparations = cpu_backward
    q, k, v = _qkv()
    _gradients(q, q, k, v, q, bundle)
    with pytest.raises(ValueError, match="multiple of nheads_kv=3"):
        _gradients(q, q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1), q, bundle)
    assert len(preparations) == 1
