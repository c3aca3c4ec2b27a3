"""flash_attn_func on fagen kernels, registered as the torch custom op ``fagen::flash_attn_fwd``.

Input requirements of the kernels (params.h): the last dimension contiguous, data pointers
16-byte aligned, batch/row/head strides multiples of 8 elements. Tensors that do not meet them
(e.g. a slice along head_dim, or a view at an odd offset) are copied to a contiguous tensor
first; any view whose last dimension is contiguous and whose strides are multiples of 8 (such as
a transpose of (batch, heads, seqlen, head_dim), or a broadcast K/V) is used as is, except that
TMA kernels (FA3) copy broadcast (stride 0) tensors, which a tensor map cannot describe.

Everything that touches files, the bundle or the driver runs inside the custom op, out of
torch.compile's sight; the public function only forwards its arguments.
"""

# No `from __future__ import annotations`: torch.library reads the op's annotations as objects.
import ctypes
import functools
import math
import os
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import paths
from ..abi import FwdParams
from ..bundle.format import Launch
from ..runtime import Bundle, LoadedKernel, driver, launch_grid, load

LOG2_E = math.log2(math.e)
# Mirrors fagen.spec.model (not imported: the runtime path stays free of pydantic).
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
ALIGNMENT_BYTES = 16
STRIDE_MULTIPLE = 8
MAX_GRID_YZ = 65535
TMA_BOX_COLUMNS = 64  # FagenTmaMaps (params.h): boxes of 64 columns, 128-byte swizzle

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

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
    """A bundle request with the environment it depends on (see bundle_path)."""
    return (
        None if bundle is None else os.fspath(bundle),
        os.environ.get("FAGEN_BUNDLE"),
        os.environ.get("FAGEN_HOME"),
    )


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


def kernel_key(dtype: torch.dtype, head_dim: int, causal: bool) -> str:
    return f"fwd/{_DTYPE_NAMES[dtype]}/hd{head_dim}/{'causal' if causal else 'full'}"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape and dtype rules (also run by the fake implementation, i.e. at trace time)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"fagen.flash_attn_func: {name} must be 4-D (batch, seqlen, nheads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"fagen.flash_attn_func: q has dtype {q.dtype}; supported: float16, bfloat16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"fagen.flash_attn_func: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    batch, _, heads_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"fagen.flash_attn_func: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
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
    if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"fagen.flash_attn_func: head_dim={head_dim}; fagen kernels take a multiple of "
            f"{HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
        )


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
    batch, seqlen, heads, head_dim = t.shape
    contiguous = (seqlen * heads * head_dim, heads * head_dim, head_dim)
    strides = []
    for size, stride, fallback in zip((batch, seqlen, heads), t.stride()[:3], contiguous):
        if size == 1:
            stride = fallback
        if stride % STRIDE_MULTIPLE or (nonzero and stride == 0):
            return None
        strides.append(stride)
    return tuple(strides)


def _kernel_ready(t: torch.Tensor, uses_tma: bool = False) -> torch.Tensor:
    if _kernel_strides(t, nonzero=uses_tma) is not None:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=1024)
def _encode_tensor_map(*arguments) -> bytes:
    """driver.encode_tiled_tensor_map, remembered: a map depends only on its arguments, and
    torch's caching allocator hands the same addresses back for same-shaped tensors, so
    repeated shapes skip the driver call."""
    return driver.encode_tiled_tensor_map(*arguments)


def _tensor_map(t: torch.Tensor, box_rows: int) -> bytes:
    batch_stride, row_stride, head_stride = _kernel_strides(t, nonzero=True)
    batch, seqlen, heads, head_dim = t.shape
    element = t.element_size()
    return _encode_tensor_map(
        _DTYPE_NAMES[t.dtype],
        t.data_ptr(),
        (head_dim, seqlen, heads, batch),
        (row_stride * element, head_stride * element, batch_stride * element),
        (TMA_BOX_COLUMNS, box_rows, 1, 1),
    )


def tma_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, launch: Launch) -> ctypes.Array:
    """FagenTmaMaps (params.h) for kernel-ready q, k, v: maps over (head_dim, seqlen, heads,
    batch), boxes of launch.tma_q_rows (Q) or launch.tma_kv_rows (K, V) rows."""
    blob = b"".join(
        _tensor_map(t, rows)
        for t, rows in ((q, launch.tma_q_rows), (k, launch.tma_kv_rows), (v, launch.tma_kv_rows))
    )
    return (ctypes.c_ubyte * len(blob)).from_buffer_copy(blob)


def fwd_params(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float
) -> FwdParams:
    """The kernel's parameter struct for kernel-ready q, k, v, a contiguous out (like q) and
    lse (batch, heads_q, seqlen_q)."""
    q_batch, q_row, q_head = _kernel_strides(q)
    k_batch, k_row, k_head = _kernel_strides(k)
    v_batch, v_row, v_head = _kernel_strides(v)
    o_batch, o_row, o_head = _kernel_strides(out)
    return FwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), lse=lse.data_ptr(),
        q_batch_stride=q_batch, q_row_stride=q_row, q_head_stride=q_head,
        k_batch_stride=k_batch, k_row_stride=k_row, k_head_stride=k_head,
        v_batch_stride=v_batch, v_row_stride=v_row, v_head_stride=v_head,
        o_batch_stride=o_batch, o_row_stride=o_row, o_head_stride=o_head,
        lse_batch_stride=lse.stride(0), lse_head_stride=lse.stride(1),
        batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
        scale_log2=scale * LOG2_E,
    )


class _PreparedLaunch(NamedTuple):
    """Everything a launch needs except the output addresses, which change per call."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    params: bytes  # FagenFwdParams with o = lse = 0
    extra_params: tuple  # TMA maps of FA3 kernels
    device: int
    # The kernel-ready q, k, v the parameters point to (copies where the inputs needed one),
    # held until the launch is enqueued; () once kept for later calls, which must not keep the
    # caller's tensors alive (the addresses are part of the cache key instead).
    inputs: tuple


def _prepare(
    kernels: Bundle, entry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float,
) -> _PreparedLaunch:
    batch, seqlen_q, heads_q, _ = q.shape
    device = q.device
    grid = launch_grid(entry, seqlen_q, heads_q, batch, device.index)
    if grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
        raise ValueError(
            f"fagen.flash_attn_func: nheads_q={heads_q} and batch={batch} must each be at most "
            f"{MAX_GRID_YZ} (CUDA grid limit)"
        )
    uses_tma = entry.launch.tma_q_rows > 0
    q, k, v = (_kernel_ready(t, uses_tma) for t in (q, k, v))
    params = fwd_params(q, k, v, out, lse, scale)
    params.o = params.lse = 0
    with torch.cuda.device(device):
        extra_params = (tma_maps(q, k, v, entry.launch),) if uses_tma else ()
    return _PreparedLaunch(kernels.kernel(entry), grid, bytes(params), extra_params, device.index,
                           (q, k, v))


# torch's raw-stream query is ~20x cheaper than torch.cuda.current_stream(device); both name the
# stream torch enqueues on for a device. Absent from torch builds without CUDA.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: int) -> int:
    if _raw_current_stream is not None:
        return _raw_current_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _launch(prepared: _PreparedLaunch, out: torch.Tensor, lse: torch.Tensor) -> None:
    params = FwdParams.from_buffer_copy(prepared.params)
    params.o, params.lse = out.data_ptr(), lse.data_ptr()
    prepared.kernel.launch(params, prepared.grid, _current_stream(prepared.device),
                           device=prepared.device, extra_params=prepared.extra_params)


def prepare_launch(
    kernels: Bundle, entry, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float,
):
    """Everything a launch of `entry` on these tensors needs (grid, kernel-ready copies, the
    parameter struct, TMA maps, the loaded kernel), done once; returns the launch itself, which
    enqueues on torch's current stream when called."""
    prepared = _prepare(kernels, entry, q, k, v, out, lse, scale)
    return functools.partial(_launch, prepared, out, lse)


# Prepared launches of earlier calls, by everything they depend on. A training or serving loop
# calls with the same shapes and, through torch's caching allocator, mostly the same addresses,
# so a repeated call skips the checks, the kernel choice and the parameter and tensor-map
# building: 124 -> 22-47 us of host time per call on the H200 hosts (bench/launch_overhead.py),
# which matters wherever the kernel itself takes about that long. Only calls whose inputs are
# used in place are kept (a copy has a fresh address each call).
_prepared_launches: dict[tuple, _PreparedLaunch] = {}
_PREPARED_LAUNCHES_KEPT = 1024  # distinct (shape, address) combinations; then start over


def _call_signature(bundle, q, k, v, causal, softmax_scale) -> tuple:
    return (_bundle_request(bundle), causal, softmax_scale, q.device, q.dtype, k.dtype, v.dtype,
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape, k.shape, v.shape,
            q.stride(), k.stride(), v.stride())


def _flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    bundle: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    signature = _call_signature(bundle, q, k, v, causal, softmax_scale)
    prepared = _prepared_launches.get(signature)
    if prepared is not None:  # the same call ran before, so it passed the checks below
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        _launch(prepared, out, lse)
        return out, lse

    _check_inputs(q, k, v)
    _check_device(q, k, v)
    kernels = get_bundle(bundle)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    entry = kernels.select(
        kernel_key(q.dtype, head_dim, causal), torch.cuda.get_device_capability(q.device), seqlen_k
    )
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        # No key to attend to: the defined result of a row that sees nothing.
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    prepared = _prepare(kernels, entry, q, k, v, out, lse, scale)
    if all(ready is given for ready, given in zip(prepared.inputs, (q, k, v))):
        if len(_prepared_launches) >= _PREPARED_LAUNCHES_KEPT:
            _prepared_launches.clear()
        _prepared_launches[signature] = prepared._replace(inputs=())
    _launch(prepared, out, lse)
    return out, lse


flash_attn_fwd = torch.library.custom_op("fagen::flash_attn_fwd", mutates_args=())(_flash_attn_fwd)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, causal, softmax_scale, bundle):
    _check_inputs(q, k, v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, head_dim))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    bundle: str | os.PathLike | Bundle | None = None,
):
    """Attention forward in flash-attn's layout: q (batch, seqlen_q, nheads_q, head_dim), k and v
    (batch, seqlen_k, nheads_kv, head_dim), fp16 or bf16 on one CUDA device.

    nheads_q must be a multiple of nheads_kv (GQA/MQA). `causal` masks bottom-right aligned
    (query row i sees keys j <= i + seqlen_k - seqlen_q, as flash-attn >= 2.1); a row that sees
    no key gives zeros and LSE -inf. `softmax_scale` defaults to 1/sqrt(head_dim). `bundle` is a
    bundle directory or a loaded Bundle; default $FAGEN_BUNDLE, else fagen's default bundle.

    Returns out (batch, seqlen_q, nheads_q, head_dim), plus, with return_lse, the natural-log
    LSE (batch, nheads_q, seqlen_q) in float32.
    """
    if isinstance(bundle, Bundle):
        get_bundle(bundle)
        bundle = str(bundle.path)
    elif bundle is not None:
        bundle = os.fspath(bundle)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    # Plain eager calls skip the dispatcher: a custom op's first call imports torch._dynamo
    # (about a second on a fast CPU, 3.6 s measured on the H200 host), which would dominate
    # cold start. Tracing (torch.compile, export, fake or other dispatch modes, tensor
    # subclasses) goes through the registered op.
    eager = (
        not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    )
    implementation = _flash_attn_fwd if eager else flash_attn_fwd
    out, lse = implementation(q, k, v, causal, softmax_scale, bundle)
    return (out, lse) if return_lse else out
