"""flash_attn_func on fagen kernels, registered as the torch custom ops ``fagen::flash_attn_fwd``
(fp16, bf16) and ``fagen::flash_attn_fwd_fp8`` (float8_e4m3fn inputs with their descales, a bf16
output; fagen.torch.e4m3).

Input requirements of the kernels (params.h): the last dimension contiguous, data pointers
16-byte aligned, batch/row/head strides multiples of 16 bytes (8 fp16/bf16 elements, 16 e4m3).
Tensors that do not meet them (e.g. a slice along head_dim, or a view at an odd offset) are
copied to a contiguous tensor first; any view whose last dimension is contiguous and whose
strides are such multiples (such as a transpose of (batch, heads, seqlen, head_dim), or a
broadcast K/V) is used as is, except that TMA kernels (FA3) copy broadcast (stride 0) tensors,
which a tensor map cannot describe.

The adapter keeps what is torch's: the tensor checks, the copies, the output allocations, the
cache of prepared launches and the custom op. Selecting, checking, parameterising and launching
the kernel is fagen.runtime.call's (the same call without torch). Everything that touches
files, the bundle or the driver runs inside the custom op, out of torch.compile's sight; the
public function only checks and forwards its arguments.
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
import functools
import inspect
import math
import os
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import contract, paths
from ..contract import ALIGNMENT_BYTES
from ..runtime import Bundle, driver, load
from ..runtime import call as runtime_call
from . import e4m3

# The element types of every call (flash_attn_func, varlen, KV cache, merge), and beside them
# those of flash_attn_func's FP8 forward: all the adapter's tensors by contract.DTYPES name.
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_ELEMENT_NAMES = {**_DTYPE_NAMES, **e4m3.FP8_DTYPE_NAMES}
_ELEMENT_DTYPES = {name: dtype for dtype, name in _ELEMENT_NAMES.items()}

_bundles: dict[str, Bundle] = {}
# Same, keyed by the unresolved request and the environment it depends on: saves resolving
# the path on every call.
_bundles_by_request: dict[tuple, Bundle] = {}
_bundles_lock = threading.Lock()


def bundle_path(bundle: str | os.PathLike | None = None) -> Path:
    """Where the adapter looks for kernels: `bundle`, else $FAGEN_BUNDLE, else the default."""
    if bundle is not None:
        return Path(bundle).resolve()
    if env := os.environ.get("FAGEN_BUNDLE"):
        return Path(env).resolve()
    return paths.default_bundle_dir().resolve()


def _bundle_request(bundle: str | os.PathLike | None) -> tuple:
    """A bundle request with the environment it depends on (see bundle_path): none for a given
    path, which spares a call the two environment lookups (each about a microsecond)."""
    if bundle is not None:
        return (os.fspath(bundle),)
    return (None, os.environ.get("FAGEN_BUNDLE"), os.environ.get("FAGEN_HOME"))


def get_bundle(bundle: str | os.PathLike | Bundle | None = None) -> Bundle:
    """The bundle for `bundle` (see bundle_path), opened once per path and cached."""
    if isinstance(bundle, Bundle):
        with _bundles_lock:
            return _bundles.setdefault(str(bundle.path), bundle)
    request = _bundle_request(bundle)
    cached = _bundles_by_request.get(request)
    if cached is not None:
        return cached
    path = str(bundle_path(bundle))
    with _bundles_lock:
        if path not in _bundles:
            _bundles[path] = load(path)
        _bundles_by_request[request] = _bundles[path]
        return _bundles[path]


def bundle_argument(bundle) -> Optional[str]:
    """A call's `bundle=` as the custom ops carry it: a directory or packed file's path, a loaded
    Bundle by its path (registered with get_bundle, which then returns it; under torch.compile,
    whose graph cannot take get_bundle's lock, by its path alone: the compiled call opens it from
    there unless an eager call registered it), or None."""
    if isinstance(bundle, Bundle):
        if not torch.compiler.is_compiling():
            get_bundle(bundle)
        return str(bundle.path)
    return None if bundle is None else os.fspath(bundle)


def eager_call(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on these tensors runs the kernels directly: not traced (torch.compile,
    export), under no dispatch mode (fake tensors), and on plain tensors (no subclasses); the
    others go through the custom ops."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    for t in tensors:  # a loop, not all(): every call asks, and a generator costs it half a microsecond
        if t is not None and type(t) is not torch.Tensor:
            return False
    return True


def define_op(name: str, implementation, fake, mutates_args: tuple[str, ...] = ()) -> torch._ops.OpOverload:
    """The torch op ``fagen::<name>`` running `implementation` (its schema from the annotations,
    the arguments named in `mutates_args` written) with `fake` for tracing. Registered with
    torch.library.define/impl, not torch.library.custom_op, whose wrappers (an autograd kernel
    in Python even on an op without autograd, then a redispatch, an aliasing check) cost each
    call 10-30 us more on a 2-core CPU (bench/host_model.py; pytorch/pytorch#139500). Like
    custom_op's kernel, it runs with dynamo off: an eager call inside a compiled region must
    not make dynamo trace fagen; and like custom_op, it bumps the written arguments' version
    counters (the kernels write through pointers, which autograd does not see)."""
    qualname = f"fagen::{name}"
    torch.library.define(qualname, torch.library.infer_schema(implementation, mutates_args=mutates_args),
                         tags=(torch.Tag.pt2_compliant_tag,))
    torch.library.impl(qualname, "default", _dynamo_disabled(implementation, mutates_args))
    torch.library.register_fake(qualname, fake)
    return getattr(torch.ops.fagen, name).default


def _dynamo_disabled(implementation, mutates_args: tuple[str, ...]):
    """`implementation` under torch.compiler.disable, applied at the first call: applying it
    imports torch._dynamo (seconds), which importing fagen.torch must not. The arguments named
    in `mutates_args` (passed by position, as the dispatcher does) get their versions bumped."""
    disabled = None
    written = tuple(list(inspect.signature(implementation).parameters).index(name) for name in mutates_args)

    @functools.wraps(implementation)
    def kernel(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(implementation)
        if written:
            torch.autograd.graph.increment_version([args[index] for index in written])
        return disabled(*args, **kwargs)

    return kernel


def kernel_key(dtype: torch.dtype, head_dim: int, mask: str, mods: tuple[str, ...] = ()) -> str:
    """The forward's key for a torch dtype (float16, bfloat16, float8_e4m3fn); mask: one of
    contract.MASKS, mods of contract.SCORE_MODS."""
    return contract.kernel_key("fwd", _ELEMENT_NAMES[dtype], head_dim, mask, mods)


def _check_score_inputs(q: torch.Tensor, softcap: float, alibi_slopes: Optional[torch.Tensor],
                        learnable_sink: Optional[torch.Tensor]) -> None:
    """The score modifiers' rules (flash-attn's shapes); also run at trace time."""
    contract.Score(softcap)  # finite, >= 0
    batch, heads = q.shape[0], q.shape[2]
    if alibi_slopes is not None:
        if alibi_slopes.shape not in ((heads,), (batch, heads)) or not alibi_slopes.is_floating_point():
            raise ValueError(f"fagen.flash_attn_func: alibi_slopes must be float of shape (nheads,) = "
                             f"({heads},) or (batch, nheads) = ({batch}, {heads}), got "
                             f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
    if learnable_sink is not None:
        if learnable_sink.shape != (heads,) or not learnable_sink.is_floating_point():
            raise ValueError(f"fagen.flash_attn_func: learnable_sink must be float of shape (nheads,) = "
                             f"({heads},), got {learnable_sink.dtype} {tuple(learnable_sink.shape)}")
    for name, t in (("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink)):
        if t is not None and t.device != q.device:
            raise ValueError(f"fagen.flash_attn_func: {name} must be on q's device {q.device}, got {t.device}")


def _check_mask_mod(q: torch.Tensor, mask_mod: Optional[str], mask_args: Optional[torch.Tensor],
                    causal: bool, window: tuple[int, int]) -> None:
    """A custom mask's rules (also run at trace time): a name, its arguments on q's device, and
    neither causal nor a window beside it."""
    if mask_mod is None:
        if mask_args is not None:
            raise ValueError("fagen.flash_attn_func: mask_args without mask_mod")
        return
    if problem := contract.custom_mask_name_problem(mask_mod):
        raise ValueError(f"fagen.flash_attn_func: mask_mod: {problem}")
    if causal or tuple(window) != (-1, -1):
        raise ValueError(f"fagen.flash_attn_func: mask_mod={mask_mod!r} replaces causal and "
                         "window_size (the custom mask decides which pairs attend)")
    if mask_args is not None and mask_args.device != q.device:
        raise ValueError(f"fagen.flash_attn_func: mask_args must be on q's device {q.device}, "
                         f"got {mask_args.device}")


def _score_arrays(alibi_slopes: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                  mask_args: Optional[torch.Tensor] = None):
    """The modifiers' arrays as the kernels read them (fp32, contiguous: copies where needed),
    a custom mask's arguments (contiguous), and the runtime's ScoreTensors of them."""
    if alibi_slopes is None and learnable_sink is None and mask_args is None:
        return _NO_SCORE_ARRAYS  # most calls: spares building the frozen dataclass (a microsecond)
    alibi = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
    sink = None if learnable_sink is None else learnable_sink.to(torch.float32).contiguous()
    args = None if mask_args is None else mask_args.contiguous()
    arrays = runtime_call.ScoreTensors(
        alibi_slopes=0 if alibi is None else alibi.data_ptr(),
        alibi_batch_stride=0 if alibi is None or alibi.dim() == 1 else alibi.shape[1],
        sinks=0 if sink is None else sink.data_ptr(),
        mask_args=0 if args is None else args.data_ptr())
    return arrays, (alibi, sink, args)


_NO_SCORE_ARRAYS = (runtime_call.ScoreTensors(), (None, None, None))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: dict = _DTYPE_NAMES) -> None:
    """Shape and dtype rules (also run by the fake implementation, i.e. at trace time); `dtypes`:
    the op's element types."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"fagen.flash_attn_func: {name} must be 4-D (batch, seqlen, nheads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    if q.dtype not in dtypes:
        supported = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise TypeError(f"fagen.flash_attn_func: q has dtype {q.dtype}; supported: {supported}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"fagen.flash_attn_func: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    batch, _, heads_q, head_dim = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"fagen.flash_attn_func: k and v must agree on (batch, seqlen, nheads): "
                         f"{tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"fagen.flash_attn_func: q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on "
            "batch and head_dim"
        )
    heads_kv = k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"fagen.flash_attn_func: nheads_q={heads_q} must be a multiple of nheads_kv={heads_kv}"
        )
    if problem := contract.head_dim_problem(head_dim):
        raise ValueError(f"fagen.flash_attn_func: {problem}")
    if v.shape[3] != head_dim and (problem := contract.head_dim_problem(v.shape[3], "head_dim_v")):
        raise ValueError(f"fagen.flash_attn_func: {problem} (v's last dimension)")


def _check_fp8_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple) -> None:
    """The FP8 op's rules (also run at trace time): e4m3 q, k, v and flash-attn's descales."""
    _check_inputs(q, k, v, e4m3.FP8_DTYPE_NAMES)
    e4m3.check_descales(q, k, descales)


def _output_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, seqlen_q, nheads_q, head_dim_v): the output has v's head dim."""
    return (*q.shape[:3], v.shape[3])


def _output_dtype(q: torch.Tensor) -> torch.dtype:
    """The output's dtype: q's, bf16 for e4m3 inputs (contract.output_dtype)."""
    return _ELEMENT_DTYPES[contract.output_dtype(_ELEMENT_NAMES[q.dtype])]


def _check_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        raise ValueError(
            "fagen.flash_attn_func: q, k, v must be CUDA tensors on one device, got "
            f"{q.device}, {k.device}, {v.device}"
        )


def _kernel_strides(t: torch.Tensor, nonzero: bool = False) -> tuple[int, int, int] | None:
    """(batch, row, head) element strides the kernel can use for `t`, or None if `t` needs a
    copy. A dimension of size 1 is never indexed, so its stride is replaced by the contiguous
    one rather than forcing a copy. `nonzero` (TMA kernels) also refuses broadcast (stride 0)
    dimensions, which a tensor map cannot describe."""
    if t.stride(3) != 1 or t.data_ptr() % ALIGNMENT_BYTES:
        return None
    multiple = contract.stride_multiple(_ELEMENT_NAMES[t.dtype])
    batch, seqlen, heads, head_dim = t.shape
    contiguous = (seqlen * heads * head_dim, heads * head_dim, head_dim)
    strides = []
    for size, stride, fallback in zip((batch, seqlen, heads), t.stride()[:3], contiguous):
        if size == 1:
            stride = fallback
        if stride % multiple or (nonzero and stride == 0):
            return None
        strides.append(stride)
    return tuple(strides)


def _kernel_ready(t: torch.Tensor, uses_tma: bool = False) -> torch.Tensor:
    if _kernel_strides(t, nonzero=uses_tma) is not None:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _tensor(t: torch.Tensor) -> runtime_call.Tensor:
    """A kernel-ready tensor as the runtime takes it."""
    return runtime_call.Tensor(t.data_ptr(), *_kernel_strides(t))


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             window: tuple[int, int], softcap: float = 0.0, alibi: bool = False,
             sinks: bool = False, mask_mod: Optional[str] = None) -> runtime_call.Problem:
    batch, seqlen_q, heads_q, head_dim = q.shape
    head_dim_v = v.shape[3]
    return runtime_call.Problem(_ELEMENT_NAMES[q.dtype], causal, batch, seqlen_q, k.shape[1],
                                heads_q, k.shape[2], head_dim, tuple(window),
                                contract.Score(softcap, alibi, sinks),
                                None if head_dim_v == head_dim else head_dim_v, mask_mod)


class _PreparedLaunch(NamedTuple):
    """A launch prepared by the runtime, and what the adapter adds: until the launch is
    enqueued, the kernel-ready q, k, v the parameters point to (copies where the inputs needed
    one) and the modifiers' fp32 arrays (an FP8 call's descales are the caller's, never copied);
    () once kept for later calls, which must not keep the caller's tensors alive (the addresses
    are part of the cache key instead). A kept one also holds what its later calls allocate
    and the backwards prepared for the eager autograd of its calls (fagen/torch/backward.py),
    whose signature this launch's proves."""

    attention: runtime_call.PreparedAttention
    inputs: tuple
    # The output's and the LSE's sizes as plain ints (torch.empty parses them twice as fast as a
    # shape), the output's dtype, the device.
    outputs: tuple = ()
    backwards: Optional[dict] = None


def _prepare(kernels: Bundle, entry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, causal: bool, window: tuple[int, int],
             softmax_scale: float | None, softcap: float = 0.0,
             alibi_slopes: Optional[torch.Tensor] = None,
             learnable_sink: Optional[torch.Tensor] = None, mask_mod: Optional[str] = None,
             mask_args: Optional[torch.Tensor] = None, descales: Optional[tuple] = None) -> _PreparedLaunch:
    uses_tma = entry.launch.tma_q_rows > 0
    q, k, v = (_kernel_ready(t, uses_tma) for t in (q, k, v))
    arrays, kept = _score_arrays(alibi_slopes, learnable_sink, mask_args)
    problem = _problem(q, k, v, causal, window, softcap, alibi_slopes is not None, learnable_sink is not None,
                       mask_mod)
    prepared = runtime_call.prepare(kernels, problem, _tensor(q), _tensor(k), _tensor(v), _tensor(out),
                                    softmax_scale, q.device.index, entry, arrays,
                                    descales=None if descales is None else e4m3.runtime_descales(descales))
    return _PreparedLaunch(prepared, (q, k, v, *kept))


# torch's raw-stream query is ~20x cheaper than torch.cuda.current_stream(device); both name the
# stream torch enqueues on for a device. Absent from torch builds without CUDA.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: int) -> int:
    if _raw_current_stream is not None:
        return _raw_current_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _launch(prepared: _PreparedLaunch, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Enqueue on torch's current stream (the caller made the primary context current)."""
    attention = prepared.attention
    workspace = 0
    if attention.workspace_bytes:
        # Freed by the caching allocator once this stream's work is done with it.
        workspace = torch.empty(attention.workspace_bytes // 4, dtype=torch.float32,
                                device=out.device).data_ptr()
    attention.enqueue(out.data_ptr(), lse.data_ptr(), _current_stream(attention.device), workspace)


def prepare_launch(
    kernels: Bundle, entry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, learnable_sink: Optional[torch.Tensor] = None,
    mask_args: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
):
    """Everything a launch of `entry` (any kernel of the bundle for its key) on these tensors
    needs, done once; returns the launch itself, which enqueues on torch's current stream when
    called. For tests and benchmarks that run a chosen kernel; `window_size` for a local one,
    the score modifiers' values and arrays for a kernel with them, a custom mask's arguments for
    a kernel with one, the descales (flash_attn_func's) for an e4m3 one, whose `out` is bf16."""
    mask = contract.KernelKey.parse(entry.key).mask
    mask_mod = None if mask in contract.MASKS else mask
    descales = (q_descale, k_descale, v_descale) if q.dtype in e4m3.FP8_DTYPE_NAMES else None
    if descales is not None:
        e4m3.check_descales(q, k, descales)
    with driver.primary_context(q.device.index):
        prepared = _prepare(kernels, entry, q, k, v, out, mask == "causal", window_size, softmax_scale,
                            softcap, alibi_slopes, learnable_sink, mask_mod, mask_args, descales)
    return functools.partial(_launch_in_primary_context, prepared, out, lse)


def _launch_in_primary_context(prepared: _PreparedLaunch, out: torch.Tensor, lse: torch.Tensor) -> None:
    with driver.primary_context(prepared.attention.device):
        _launch(prepared, out, lse)


# Prepared launches of earlier calls, by everything they depend on. A training or serving loop
# calls with the same shapes and, through torch's caching allocator, mostly the same addresses,
# so a repeated call skips the checks, the kernel choice and the parameter and tensor-map
# building: 124 -> 22-47 us of host time per call on the H200 hosts (bench/launch_overhead.py),
# which matters wherever the kernel itself takes about that long. Only calls whose inputs are
# used in place are kept (a copy has a fresh address each call).
_prepared_launches: dict[tuple, _PreparedLaunch] = {}
_PREPARED_LAUNCHES_KEPT = 1024  # distinct (shape, address) combinations; then start over


def _array_signature(t: Optional[torch.Tensor]) -> tuple:
    return () if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())


def _call_signature(bundle, q, k, v, causal, window, softmax_scale, softcap, alibi_slopes,
                    learnable_sink, mask_mod=None, mask_args=None, descales=None) -> tuple:
    return (_bundle_request(bundle), causal, window, softmax_scale, softcap, q.device, q.dtype, k.dtype, v.dtype,
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape, k.shape, v.shape,
            q.stride(), k.stride(), v.stride(), _array_signature(alibi_slopes),
            _array_signature(learnable_sink), mask_mod, _array_signature(mask_args),
            () if descales is None else tuple(map(_array_signature, descales)))


def _flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    softmax_scale: Optional[float],
    bundle: Optional[str],
    deterministic: bool = False,
    mask_mod: Optional[str] = None,
    mask_args: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out, lse of one forward. `deterministic` is the backward's (saved for it by the op's
    autograd, fagen/torch/backward.py); the forward is deterministic anyway. `mask_mod`: a
    custom mask's name, `mask_args` its arguments."""
    return _forward(q, k, v, causal, (window_left, window_right), softmax_scale, bundle, softcap, alibi_slopes,
                    learnable_sink, mask_mod, mask_args)[:2]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple[int, int],
             softmax_scale: Optional[float], bundle: Optional[str], softcap: float = 0.0,
             alibi_slopes: Optional[torch.Tensor] = None, learnable_sink: Optional[torch.Tensor] = None,
             mask_mod: Optional[str] = None, mask_args: Optional[torch.Tensor] = None,
             descales: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[_PreparedLaunch]]:
    """out, lse of either forward op: fp16/bf16 inputs (`descales` None), or e4m3 inputs with
    their three descales (each None: 1.0) and a bf16 output; and the launch kept for later calls
    of this signature (None: the call is not kept, see below)."""
    # Allocations and the launch run in the device's primary context (torch's), whatever the
    # caller had current: memory and streams belong to the context they were made in.
    signature = _call_signature(bundle, q, k, v, causal, window, softmax_scale, softcap, alibi_slopes,
                                learnable_sink, mask_mod, mask_args, descales)
    prepared = _prepared_launches.get(signature)
    if prepared is not None:  # the same call ran before, so it passed the checks below
        out_sizes, lse_sizes, out_dtype, device = prepared.outputs
        with driver.primary_context(prepared.attention.device):
            out = torch.empty(*out_sizes, dtype=out_dtype, device=device)
            lse = torch.empty(*lse_sizes, dtype=torch.float32, device=device)
            _launch(prepared, out, lse)
        return out, lse, prepared

    if descales is None:
        _check_inputs(q, k, v)
        _check_score_inputs(q, softcap, alibi_slopes, learnable_sink)
        _check_mask_mod(q, mask_mod, mask_args, causal, window)
    else:
        _check_fp8_inputs(q, k, v, descales)
    _check_device(q, k, v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    contract.kernel_scale_log2(softmax_scale, head_dim)  # refused before any allocation
    kernels = get_bundle(bundle)
    device = q.device.index
    problem = _problem(q, k, v, causal, window, softcap, alibi_slopes is not None, learnable_sink is not None,
                       mask_mod)
    runtime_call.check_problem(problem)  # the window's sizes, before any allocation
    entry = runtime_call.select(kernels, problem, device)
    with driver.primary_context(device):
        out = torch.empty(_output_shape(q, v), dtype=_output_dtype(q), device=q.device)
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out, lse, None
        if k.shape[1] == 0:
            # No key to attend to: the defined result of a row that sees nothing (with a sink:
            # the sink alone, whose value is 0).
            out.zero_()
            if learnable_sink is None:
                lse.fill_(-math.inf)
            else:
                lse.copy_(learnable_sink.to(torch.float32).view(1, heads_q, 1).expand_as(lse))
            return out, lse, None
        prepared = _prepare(kernels, entry, q, k, v, out, causal, window, softmax_scale, softcap,
                            alibi_slopes, learnable_sink, mask_mod, mask_args, descales)
        _launch(prepared, out, lse)
        given = (q, k, v, alibi_slopes, learnable_sink, mask_args)
        if not all(ready is None or ready is arg for ready, arg in zip(prepared.inputs, given)):
            return out, lse, None
        kept = prepared._replace(inputs=(), outputs=(tuple(out.shape), tuple(lse.shape), out.dtype, out.device),
                                 backwards={})
        if len(_prepared_launches) >= _PREPARED_LAUNCHES_KEPT:
            _prepared_launches.clear()
        _prepared_launches[signature] = kept
    return out, lse, kept


def _flash_attn_fwd_fake(q, k, v, alibi_slopes, learnable_sink, causal, window_left, window_right, softcap,
                         softmax_scale, bundle, deterministic=False, mask_mod=None, mask_args=None):
    _check_inputs(q, k, v)
    _check_score_inputs(q, softcap, alibi_slopes, learnable_sink)
    _check_mask_mod(q, mask_mod, mask_args, causal, (window_left, window_right))
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(_output_shape(q, v))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


flash_attn_fwd = define_op("flash_attn_fwd", _flash_attn_fwd, _flash_attn_fwd_fake)


def _flash_attn_fwd_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    softmax_scale: Optional[float],
    bundle: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (bf16), lse of one forward of float8_e4m3fn q, k, v with flash-attn's descales (None:
    1.0; fagen.runtime.e4m3 says how the kernels apply them). Forward only: no autograd."""
    return _forward(q, k, v, causal, (window_left, window_right), softmax_scale, bundle,
                    descales=(q_descale, k_descale, v_descale))[:2]


def _flash_attn_fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, causal, window_left, window_right,
                             softmax_scale, bundle):
    _check_fp8_inputs(q, k, v, (q_descale, k_descale, v_descale))
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(_output_shape(q, v), dtype=_output_dtype(q))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


flash_attn_fwd_fp8 = define_op("flash_attn_fwd_fp8", _flash_attn_fwd_fp8, _flash_attn_fwd_fp8_fake)
