"""One attention forward on device pointers, no torch: the Python twin of fagen.hpp's
``Bundle::attention``.

``prepare`` does everything a launch needs once (the checks of params.h and the contract, the
kernel choice, the parameter struct, the TMA maps, the grid); the returned ``PreparedAttention``
launches it for any output address on any stream of the device. ``attention`` is both in one
call. Tensors are in flash-attn's layout (batch, seqlen, heads, head_dim), given as a device
address and (batch, row, head) element strides, the last dimension contiguous. q, k and v are of
the problem's dtype, the output of contract.output_dtype(dtype) (e4m3 inputs: a bf16 output,
their descales given as a fagen.runtime.e4m3.Descales).

The kernels run in the device's primary context (the one torch and the CUDA runtime use): the
pointers and the stream must belong to it; the caller's current context is current again
afterwards.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from .. import contract
from ..abi import BwdParams, FwdParams
from ..contract import ALIGNMENT_BYTES, MAX_GRID_YZ, KernelEntry
from . import driver, e4m3
from .e4m3 import Descales
from .loader import Bundle, LoadedKernel, launch_grid


class AttentionError(ValueError):
    """A call the kernels cannot run as given (sizes, strides, alignment, scale)."""


@dataclass(frozen=True)
class Tensor:
    """A (batch, seqlen, heads, head_dim) device tensor: its address and element strides."""

    data: int
    batch_stride: int
    row_stride: int
    head_stride: int

    @classmethod
    def contiguous(cls, data: int, seqlen: int, heads: int, head_dim: int) -> "Tensor":
        return cls(data, seqlen * heads * head_dim, heads * head_dim, head_dim)

    @property
    def strides(self) -> tuple[int, int, int]:
        return (self.batch_stride, self.row_stride, self.head_stride)


@dataclass(frozen=True)
class Problem:
    """The shape of one call: q (batch, seqlen_q, heads_q, head_dim), k (batch, seqlen_k,
    heads_kv, head_dim), v (batch, seqlen_k, heads_kv, head_dim_v; None: head_dim), out (batch,
    seqlen_q, heads_q, head_dim_v), lse (batch, heads_q, seqlen_q) fp32; the mask from `causal`
    and `window_size` by flash-attn's rule (contract.call_mask); the score modifiers (softcap
    value, whether ALiBi slopes and sinks come with the call: their arrays are ScoreTensors)."""

    dtype: str  # of q, k and v: contract.DTYPES; the output's is contract.output_dtype(dtype)
    causal: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    window_size: tuple[int, int] = (-1, -1)
    score: contract.Score = contract.Score()
    head_dim_v: int | None = None
    # A custom mask's name (a bundle's kernels built with it; its arguments are ScoreTensors'
    # mask_args): it replaces causal and window_size, which stay False and (-1, -1).
    mask_mod: str | None = None
    # contract.LAYOUTS: paged is a call over a KV cache (fagen.runtime.kvcache), whose seqlen_q
    # and seqlen_k are the longest row's and the cache's capacity per row.
    layout: str = contract.LAYOUTS[0]
    # k's and v's element where it differs from dtype (None: dtype): an e4m3 KV cache under
    # fp16 / bf16 queries (the paged layout; contract.CACHE_DTYPES).
    kv_dtype: str | None = None

    @property
    def mask(self) -> contract.Mask:
        if self.mask_mod is not None:
            return contract.Mask(self.mask_mod)
        mask = contract.call_mask(self.causal, self.window_size, self.seqlen_q, self.seqlen_k)
        if self.layout == "paged":  # its kernels take every built-in mask as a band
            return contract.banded(mask, self.seqlen_q, self.seqlen_k)
        return mask

    @property
    def value_dim(self) -> int:
        """v's and the output's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def direction_key(self, direction: str) -> str:
        return contract.kernel_key(direction, self.dtype, self.head_dim, self.mask.kind, self.score.mods,
                                   self.head_dim_v, self.layout, self.kv_dtype)

    @property
    def cache_dtype(self) -> str:
        """k's and v's element type."""
        return self.kv_dtype or self.dtype

    @property
    def key(self) -> str:
        return self.direction_key("fwd")


@dataclass(frozen=True)
class ScoreTensors:
    """The device arrays of a call's score modifiers (0: not given): ALiBi slopes, fp32 of
    (heads_q,) with alibi_batch_stride 0 or of (batch, heads_q) with alibi_batch_stride heads_q;
    sinks, fp32 (heads_q,); a backward's dsinks, fp32 (heads_q,), which it writes; and a custom
    mask's arguments (what its header's type reads, e.g. each token's document id)."""

    alibi_slopes: int = 0
    alibi_batch_stride: int = 0
    sinks: int = 0
    dsinks: int = 0
    mask_args: int = 0


@dataclass(frozen=True)
class Varlen:
    """The packing of a varlen call (contract.LAYOUTS; FagenFwdParams / FagenBwdParams): device
    int32 arrays of (batch + 1) offsets, cu_seqlens_q into q and the output ((total_q, heads_q,
    head_dim)), cu_seqlens_k into k and v ((total_k, heads_kv, head_dim)); total_q and total_k
    are those tensors' rows; seqused_k (forward only; 0: none) a device int32 (batch,) of keys
    used per batch row. The problem's batch is the number of rows, its seqlen_q and seqlen_k
    the longest ones' (they size the grid); its tensors' batch strides are ignored."""

    cu_seqlens_q: int
    cu_seqlens_k: int
    total_q: int
    total_k: int
    seqused_k: int = 0


def _check_varlen(problem: Problem, varlen: Varlen | None) -> None:
    if (problem.layout == "varlen") != (varlen is not None):
        raise AttentionError("a varlen problem (layout='varlen') and its Varlen packing come together")
    if varlen is None:
        return
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        address = getattr(varlen, name)
        if address == 0 or address % 4:
            raise AttentionError(f"{name}: a non-null, 4-byte aligned int32 device array of "
                                 f"(batch + 1,) = ({problem.batch + 1},) offsets is needed")
    if varlen.seqused_k % 4:
        raise AttentionError("seqused_k: a 4-byte aligned int32 device array of (batch,)")
    if min(varlen.total_q, varlen.total_k) < 0 or varlen.total_q < problem.seqlen_q or varlen.total_k < problem.seqlen_k:
        raise AttentionError(f"max_seqlen_q={problem.seqlen_q} / max_seqlen_k={problem.seqlen_k} cannot "
                             f"exceed the packed rows total_q={varlen.total_q} / total_k={varlen.total_k}")


def _packed(tensor: Tensor) -> Tensor:
    """A varlen tensor's strides as the kernels take them: no batch stride."""
    return Tensor(tensor.data, 0, tensor.row_stride, tensor.head_stride)


def _check_score_tensors(problem: Problem, arrays: ScoreTensors, backward: bool = False) -> None:
    needed = {"alibi_slopes": problem.score.alibi, "sinks": problem.score.sinks,
              "dsinks": backward and problem.score.sinks}
    for name, wanted in needed.items():
        address = getattr(arrays, name)
        if wanted and (address == 0 or address % 4):
            raise AttentionError(f"{name}: a non-null, 4-byte aligned fp32 device array of "
                                 f"({problem.heads_q},) is needed for this call")
    if problem.score.alibi and arrays.alibi_batch_stride not in (0, problem.heads_q):
        raise AttentionError(f"alibi_slopes: batch stride {arrays.alibi_batch_stride} must be 0 "
                             f"((nheads,) slopes) or nheads={problem.heads_q} ((batch, nheads))")


def check_problem(problem: Problem) -> None:
    """The shape rules every kernel shares; raises AttentionError."""
    if problem.layout not in contract.LAYOUTS:
        raise AttentionError(f"layout {problem.layout!r}: one of {', '.join(contract.LAYOUTS)}")
    if problem.dtype not in contract.DTYPES:
        raise AttentionError(f"dtype {problem.dtype!r}: fagen kernels take {', '.join(contract.DTYPES)}")
    sizes = (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.heads_kv)
    if min(sizes) < 0:
        raise AttentionError(f"negative size in {problem}")
    if problem.heads_kv == 0 or problem.heads_q % problem.heads_kv:
        raise AttentionError(
            f"nheads_q={problem.heads_q} must be a multiple of nheads_kv={problem.heads_kv}")
    if found := contract.head_dim_problem(problem.head_dim):
        raise AttentionError(found)
    if problem.head_dim_v is not None and (found := contract.head_dim_problem(problem.head_dim_v, "head_dim_v")):
        raise AttentionError(found)
    if problem.mask_mod is not None:
        if found := contract.custom_mask_name_problem(problem.mask_mod):
            raise AttentionError(found)
        if problem.causal or tuple(problem.window_size) != (-1, -1):
            raise AttentionError(f"mask_mod={problem.mask_mod!r} replaces causal and window_size: "
                                 "leave them False and (-1, -1) (the custom mask decides which "
                                 "pairs attend)")
    try:
        problem.mask
    except contract.MaskError as error:
        raise AttentionError(str(error)) from None
    if not isinstance(problem.score, contract.Score):
        raise AttentionError(f"score={problem.score!r}: a fagen.contract.Score")
    if problem.dtype == e4m3.E4M3 and (
            found := e4m3.call_problem("fwd", problem.layout, problem.score.mods, problem.mask_mod)):
        raise AttentionError(found)
    if problem.cache_dtype != problem.dtype and (
            found := e4m3.cache_problem(problem.dtype, problem.cache_dtype, problem.layout)):
        raise AttentionError(found)


def _check_descales(problem: Problem, descales: Descales | None) -> None:
    if found := e4m3.descales_problem(problem.dtype, descales, problem.kv_dtype):
        raise AttentionError(found)


def _check_tensor(name: str, tensor: Tensor, tma: bool, dtype: str = "bf16") -> None:
    """params.h's rule for a tensor of element `dtype` (fp16 and bf16, the default, share it):
    16-byte aligned, strides of whole 16-byte vectors (contract.stride_multiple), non-zero
    where a TMA map describes it."""
    multiple = contract.stride_multiple(dtype)
    if tensor.data == 0 or tensor.data % ALIGNMENT_BYTES:
        raise AttentionError(f"{name} must be a non-null, {ALIGNMENT_BYTES}-byte aligned device pointer")
    for stride in tensor.strides:
        if stride % multiple or stride < 0 or (tma and stride == 0):
            raise AttentionError(
                f"{name} strides {tensor.strides} must be multiples of {multiple} elements"
                + (" and non-zero (TMA kernel)" if tma else ""))


@functools.lru_cache(maxsize=1024)
def _encode_tensor_map(*arguments) -> bytes:
    """driver.encode_tiled_tensor_map, remembered: a map depends only on its arguments, and a
    caching allocator hands the same addresses back for same-shaped tensors, so repeated shapes
    skip the driver call."""
    return driver.encode_tiled_tensor_map(*arguments)


def _tensor_map(dtype: str, tensor: Tensor, seqlen: int, heads: int, batch: int, head_dim: int,
                box_rows: int) -> bytes:
    element = contract.DTYPE_BYTES[dtype]
    return _encode_tensor_map(
        dtype, tensor.data, (head_dim, seqlen, heads, batch),
        (tensor.row_stride * element, tensor.head_stride * element, tensor.batch_stride * element),
        (contract.tma_box_columns(dtype), box_rows, 1, 1),
    )


def _map_rows(problem: Problem, varlen: Varlen | None) -> tuple[int, int, int]:
    """(rows of q, rows of k, batch) that the tensor maps span: a varlen call's packed rows as
    one batch row (algo/batch_row.cuh)."""
    if varlen is None:
        return problem.seqlen_q, problem.seqlen_k, problem.batch
    return max(varlen.total_q, 1), max(varlen.total_k, 1), 1


def _map_tensor(tensor: Tensor, rows: int) -> Tensor:
    """A varlen tensor as its map of one batch row takes it: a batch stride (never used) that
    encodes."""
    return Tensor(tensor.data, rows * tensor.row_stride, tensor.row_stride, tensor.head_stride)


def _qkv_map_blob(problem: Problem, q: Tensor, k: Tensor, v: Tensor, launch: contract.Launch,
                  varlen: Varlen | None = None, workspace: int = 0) -> bytes:
    p = problem
    rows_q, rows_k, batch = _map_rows(problem, varlen)
    if varlen is not None:
        q, k, v = _map_tensor(q, rows_q), _map_tensor(k, rows_k), _map_tensor(v, rows_k)
    qk_maps = (_tensor_map(p.dtype, q, rows_q, p.heads_q, batch, p.head_dim, launch.tma_q_rows),
               _tensor_map(p.dtype, k, rows_k, p.heads_kv, batch, p.head_dim, launch.tma_kv_rows))
    if p.dtype == e4m3.E4M3:  # V^T in the workspace (contract.E4M3_VT_SUFFIX); dense only
        keys = contract.vt_keys(p.seqlen_k)
        vt = Tensor(workspace, p.heads_kv * p.value_dim * keys, keys, p.value_dim * keys)
        return b"".join((*qk_maps, _tensor_map(p.dtype, vt, p.value_dim, p.heads_kv, batch, keys, p.value_dim)))
    return b"".join((*qk_maps, _tensor_map(p.dtype, v, rows_k, p.heads_kv, batch, p.value_dim, launch.tma_kv_rows)))


def _blob_array(blob: bytes) -> ctypes.Array:
    return (ctypes.c_ubyte * len(blob)).from_buffer_copy(blob)


def tma_maps(problem: Problem, q: Tensor, k: Tensor, v: Tensor, launch: contract.Launch,
             varlen: Varlen | None = None, workspace: int = 0) -> ctypes.Array:
    """FagenTmaMaps (params.h): maps over (head_dim, seqlen, heads, batch) (V: head_dim_v) of
    the problem's dtype, boxes of one 128-byte swizzle row (contract.tma_box_columns) by
    launch.tma_q_rows (Q) or launch.tma_kv_rows (K, V) rows; varlen: over the packed rows,
    batch 1. e4m3: the V map is over the V^T at `workspace` (contract.E4M3_VT_SUFFIX):
    (vt_keys, head_dim_v, heads_kv, batch), boxes of 128 keys by head_dim_v rows."""
    return _blob_array(_qkv_map_blob(problem, q, k, v, launch, varlen, workspace))


def bwd_tma_maps(problem: Problem, t: "BackwardTensors", launch: contract.Launch,
                 dq_accum: int, varlen: Varlen | None = None) -> ctypes.Array:
    """FagenBwdTmaMaps (params.h): Q, K, V as tma_maps(), dO like the output; and the fp32 dQ
    accumulator at `dq_accum`, (batch, heads_q, seqlen_q, head_dim) with
    contract.dq_accum_rows(seqlen_q) rows per head (varlen: (1, heads_q, varlen_accum_rows)), in
    boxes of ACCUM_BOX_COLUMNS x tma_q_rows."""
    p = problem
    rows_q, _, batch = _map_rows(problem, varlen)
    row_bytes = p.head_dim * contract.ACCUM_BYTES
    accum_rows = (contract.dq_accum_rows(p.seqlen_q) if varlen is None
                  else contract.varlen_accum_rows(varlen.total_q, p.batch))
    head_bytes = row_bytes * accum_rows
    return _blob_array(b"".join((
        _qkv_map_blob(problem, t.q, t.k, t.v, launch, varlen),
        _tensor_map(p.dtype, t.dout if varlen is None else _map_tensor(t.dout, rows_q), rows_q, p.heads_q,
                    batch, p.value_dim, launch.tma_q_rows),
        _encode_tensor_map("fp32", dq_accum, (p.head_dim, accum_rows if varlen else p.seqlen_q, p.heads_q, batch),
                           (row_bytes, head_bytes, head_bytes * p.heads_q),
                           (contract.ACCUM_BOX_COLUMNS, launch.tma_q_rows, 1, 1)),
    )))


def _score_fields(scale: contract.KernelScale, arrays: ScoreTensors) -> dict:
    """The score-modifier fields both parameter structs share (params.h)."""
    return dict(scale_log2=scale.scale_log2, softcap_scale=scale.softcap_scale,
                alibi_slopes=arrays.alibi_slopes or None, alibi_batch_stride=arrays.alibi_batch_stride,
                sinks=arrays.sinks or None, mask_args=arrays.mask_args or None)


def fwd_params(problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
               scale: contract.KernelScale, arrays: ScoreTensors = ScoreTensors(),
               varlen: Varlen | None = None, descales: Descales | None = None) -> FwdParams:
    """FagenFwdParams with o = lse = 0 (the launch fills them); lse is (batch, heads_q,
    seqlen_q) contiguous (varlen: (heads_q, total_q)); descales: an e4m3 call's (None: 1.0)."""
    p = problem
    if varlen is not None:
        params = fwd_params(problem, _packed(q), _packed(k), _packed(v), _packed(out), scale, arrays,
                            descales=descales)
        params.lse_batch_stride, params.lse_head_stride = 0, varlen.total_q
        params.cu_seqlens_q, params.cu_seqlens_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
        params.seqused_k = varlen.seqused_k or None
        return params
    return FwdParams(
        q=q.data, k=k.data, v=v.data, o=0, lse=0,
        q_batch_stride=q.batch_stride, q_row_stride=q.row_stride, q_head_stride=q.head_stride,
        k_batch_stride=k.batch_stride, k_row_stride=k.row_stride, k_head_stride=k.head_stride,
        v_batch_stride=v.batch_stride, v_row_stride=v.row_stride, v_head_stride=v.head_stride,
        o_batch_stride=out.batch_stride, o_row_stride=out.row_stride, o_head_stride=out.head_stride,
        lse_batch_stride=p.heads_q * p.seqlen_q, lse_head_stride=p.seqlen_q,
        batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, seqlen_q=p.seqlen_q,
        seqlen_k=p.seqlen_k, window_left=p.mask.window_left, window_right=p.mask.window_right,
        **_score_fields(scale, arrays), **(descales or Descales()).params_fields(),
    )


@dataclass(frozen=True)
class VtLaunch:
    """An e4m3 forward's V^T companion (contract.E4M3_VT_SUFFIX): its grid, and what the maps
    over the call's tensors and the V^T in the workspace are made of (tma_maps)."""

    grid: tuple[int, int, int]
    problem: Problem
    tensors: tuple[Tensor, Tensor, Tensor]  # q, k, v
    launch: contract.Launch

    def maps(self, workspace: int) -> ctypes.Array:
        return tma_maps(self.problem, *self.tensors, self.launch, workspace=workspace)


@dataclass(frozen=True)
class PreparedAttention:
    """A checked, selected and parameterised launch; ``launch`` adds the output addresses."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    params: bytes  # FagenFwdParams with o = lse = 0
    extra_params: tuple  # FagenTmaMaps of TMA kernels (an e4m3 forward's: vt.maps)
    device: int
    # The scratch the kernel needs, 0: none: FA1's fp32 rows, an e4m3 forward's V^T.
    workspace_bytes: int
    vt: VtLaunch | None = None

    def enqueue(self, out: int, lse: int, stream: int, workspace: int = 0) -> None:
        """launch() for a caller that made the device's primary context current."""
        params = FwdParams.from_buffer_copy(self.params)
        params.o, params.lse = out, lse
        extra = self.extra_params
        if self.workspace_bytes and (not workspace or (self.vt is not None and workspace % ALIGNMENT_BYTES)):
            raise AttentionError(f"kernel {self.kernel.entry.name} needs a workspace of "
                                 f"{self.workspace_bytes} bytes" + (", 16-byte aligned" if self.vt else ""))
        if self.vt is not None:
            self.kernel.enqueue_companion(contract.E4M3_VT_SUFFIX, params, self.vt.grid,
                                          contract.vt_threads(self.vt.problem.value_dim), stream,
                                          (ctypes.c_void_p(workspace),))
            extra = (self.vt.maps(workspace),)
        elif self.workspace_bytes:
            extra = (*extra, ctypes.c_void_p(workspace))
        self.kernel.enqueue(params, self.grid, stream, self.device, extra)

    def launch(self, out: int, lse: int, stream: int, workspace: int = 0) -> None:
        """Enqueue on `stream` with the output at `out` (strides as prepared) and the LSE at
        `lse` (0: not written); `workspace`: a device buffer of workspace_bytes (16-byte
        aligned; an e4m3 forward's companion writes V^T there first, on the same stream)."""
        with driver.primary_context(self.device):
            self.enqueue(out, lse, stream, workspace)


def _check_entry(entry: KernelEntry, key: str) -> None:
    """A kernel given by the caller must be one of the call's key: another mask or modifier would
    read arrays the call does not have (a sink kernel without sinks reads address 0)."""
    if entry.key != key:
        raise AttentionError(f"kernel {entry.name} is a {entry.key} kernel; this call needs {key}")


def select(bundle: Bundle, problem: Problem, device: int = 0,
           fa_version: int | None = None) -> KernelEntry:
    """The kernel `problem` runs on the device: the newest algorithm (or `fa_version`), the
    closest build, the best seqlen_k bound (fagen.runtime.loader.select)."""
    return bundle.select(problem.key, driver.compute_capability(device), problem.seqlen_k,
                         fa_version=fa_version)


def prepare(bundle: Bundle, problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
            softmax_scale: float | None = None, device: int = 0,
            entry: KernelEntry | None = None,
            score_tensors: ScoreTensors = ScoreTensors(),
            varlen: Varlen | None = None, *, descales: Descales | None = None) -> PreparedAttention:
    """Check the call, pick its kernel for the device (select(), unless `entry` names one of the
    bundle's kernels) and build everything its launches need; `varlen`: the packing of a varlen
    problem; `descales`: an e4m3 problem's (None: all 1.0). Raises AttentionError for a call the
    kernels cannot run, KernelNotFound when the bundle has no kernel for it, ScaleError for a
    softmax_scale they cannot answer."""
    check_problem(problem)
    _check_varlen(problem, varlen)
    if problem.seqlen_k == 0:
        raise AttentionError("need seqlen_k >= 1: without keys every row's result is O = 0 and "
                             "LSE = -inf, which the caller writes")
    _check_score_tensors(problem, score_tensors)
    _check_descales(problem, descales)
    scale = contract.kernel_score_scale(softmax_scale, problem.head_dim, problem.score.softcap)
    entry = entry or select(bundle, problem, device)
    _check_entry(entry, problem.key)
    grid = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device)
    if (varlen is not None and entry.launch.grid == "persistent"
            and contract.varlen_walks_items(problem.batch, problem.seqlen_q, varlen.total_q)):
        grid = entry.launch.grid_dims(problem.seqlen_q, problem.heads_q, problem.batch, 1 << 31)
    if grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
        raise AttentionError(f"nheads_q={problem.heads_q} and batch={problem.batch} must each be "
                             f"at most {MAX_GRID_YZ} (CUDA grid limit)")
    tma = entry.launch.tma_q_rows > 0
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, tensor if varlen is None else _map_tensor(tensor, 1), tma, problem.dtype)
    _check_tensor("out", out, False, contract.output_dtype(problem.dtype))
    params = fwd_params(problem, q, k, v, out, scale, score_tensors, varlen, descales)
    if problem.dtype == e4m3.E4M3:  # dense only (check_problem)
        p = problem
        vt = VtLaunch(contract.vt_grid(p.seqlen_k, p.heads_kv, p.batch), p, (q, k, v), entry.launch)
        return PreparedAttention(bundle.kernel(entry), grid, bytes(params), (), device,
                                 contract.vt_workspace_bytes(p.batch, p.heads_kv, p.value_dim, p.seqlen_k), vt)
    extra = (tma_maps(problem, q, k, v, entry.launch, varlen),) if tma else ()
    workspace = 4 * entry.launch.workspace_floats(problem.seqlen_q, problem.heads_q, problem.batch)
    return PreparedAttention(bundle.kernel(entry), grid, bytes(params), extra, device, workspace)


def attention(bundle: Bundle, problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
              lse: int = 0, *, softmax_scale: float | None = None, stream: int = 0,
              device: int = 0, workspace: int = 0,
              score_tensors: ScoreTensors = ScoreTensors(), descales: Descales | None = None) -> None:
    """prepare() and launch() in one call, asynchronous on `stream`; a call without any output
    element launches nothing. Rows that see no key get 0 and LSE -inf."""
    if problem.batch * problem.seqlen_q * problem.heads_q == 0:
        check_problem(problem)
        _check_descales(problem, descales)
        return
    prepare(bundle, problem, q, k, v, out, softmax_scale, device,
            score_tensors=score_tensors, descales=descales).launch(out.data, lse, stream, workspace)


# ---------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class BackwardTensors:
    """The tensors of one backward: the forward's inputs and outputs (q, k, v, out, and lse as
    an address of (batch, heads_q, seqlen_q) fp32), the output's gradient dout, and the
    gradients to write (dq like q; dk, dv like k, v)."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    dout: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    lse: int


def select_backward(bundle: Bundle, problem: Problem, device: int = 0,
                    fa_version: int | None = None) -> KernelEntry:
    """The backward kernel for `problem` on the device (the key of its backward direction)."""
    return bundle.select(problem.direction_key("bwd"), driver.compute_capability(device), problem.seqlen_k,
                         fa_version=fa_version)


def backward_workspace(entry: KernelEntry, problem: Problem,
                       total_q: int | None = None) -> contract.BackwardWorkspace:
    """What a backward of `problem` on `entry` needs beside its outputs (sizes in floats and
    ints): the caller allocates one fp32 buffer of .floats and, for the deterministic mode, a
    zeroed int32 buffer of .semaphores. A varlen problem gives its packed rows `total_q`."""
    if problem.layout == "varlen":
        return contract.BackwardWorkspace.varlen(problem.batch, problem.heads_q, total_q, problem.seqlen_q,
                                                 problem.head_dim, entry.launch.block_m)
    return contract.BackwardWorkspace.of(problem.batch, problem.heads_q, problem.seqlen_q,
                                         problem.head_dim, entry.launch.block_m)


def _bwd_params(problem: Problem, t: BackwardTensors, layout: contract.BackwardWorkspace,
                workspace: int, semaphores: int, scale: contract.KernelScale,
                softmax_scale: float | None, arrays: ScoreTensors, varlen: Varlen | None = None) -> BwdParams:
    p = problem
    if varlen is not None:
        packed = BackwardTensors(*(_packed(getattr(t, f)) for f in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")),
                                 lse=t.lse)
        params = _bwd_params(problem, packed, layout, workspace, semaphores, scale, softmax_scale, arrays)
        params.lse_batch_stride, params.lse_head_stride = 0, varlen.total_q
        params.cu_seqlens_q, params.cu_seqlens_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
        params.total_q = varlen.total_q
        return params
    params = BwdParams(
        q=t.q.data, k=t.k.data, v=t.v.data, o=t.out.data, dout=t.dout.data, lse=t.lse,
        dq=t.dq.data, dk=t.dk.data, dv=t.dv.data,
        dq_accum=workspace + 4 * layout.dq_accum, softmax_d=workspace + 4 * layout.softmax_d,
        lse_log2=workspace + 4 * layout.lse_log2, dq_semaphore=semaphores or None,
        sink_partials=workspace + 4 * layout.sink_partials, dsinks=arrays.dsinks or None,
        lse_batch_stride=p.heads_q * p.seqlen_q, lse_head_stride=p.seqlen_q,
        batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, seqlen_q=p.seqlen_q,
        seqlen_k=p.seqlen_k, window_left=p.mask.window_left, window_right=p.mask.window_right,
        **_score_fields(scale, arrays),
        softmax_scale=contract.default_softmax_scale(p.head_dim) if softmax_scale is None
        else softmax_scale,
    )
    # params.h's stride prefixes: o and do for out and dout.
    for prefix, tensor in (("q", t.q), ("k", t.k), ("v", t.v), ("o", t.out), ("do", t.dout),
                           ("dq", t.dq), ("dk", t.dk), ("dv", t.dv)):
        for dim, stride in zip(("batch", "row", "head"), tensor.strides):
            setattr(params, f"{prefix}_{dim}_stride", stride)
    return params


def _checked_backward(bundle: Bundle, problem: Problem, tensors: BackwardTensors, deterministic: bool,
                      softmax_scale: float | None, device: int, entry: KernelEntry | None,
                      score_tensors: ScoreTensors, varlen: Varlen | None) -> tuple:
    """The checks of a backward call; its kernel (select_backward(), unless `entry` names one),
    the main kernel's grid, the preprocess's and dQ conversion's grid, and the kernel scale."""
    if problem.dtype == e4m3.E4M3:
        raise AttentionError(e4m3.call_problem("bwd", problem.layout, problem.score.mods, problem.mask_mod))
    check_problem(problem)
    _check_varlen(problem, varlen)
    if problem.seqlen_k == 0 or problem.batch * problem.seqlen_q * problem.heads_q == 0:
        raise AttentionError("the backward needs seqlen_q, seqlen_k, heads and batch >= 1 (the "
                             "gradients of an empty attention are zeros, which the caller writes)")
    _check_score_tensors(problem, score_tensors, backward=True)
    if problem.mask_mod is not None and deterministic:
        raise AttentionError(f"mask_mod={problem.mask_mod!r}: the deterministic mode takes the built-in "
                             "masks only (its dQ order follows their key ranges)")
    scale = contract.kernel_score_scale(softmax_scale, problem.head_dim, problem.score.softcap)
    entry = entry or select_backward(bundle, problem, device)
    _check_entry(entry, problem.direction_key("bwd"))
    grid = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                       problem.seqlen_k, problem.heads_kv)
    rows = contract.bwd_row_grid(problem.seqlen_q, problem.heads_q, problem.batch)
    if max(grid[1], grid[2], rows[1], rows[2]) > MAX_GRID_YZ:
        raise AttentionError(f"nheads_q={problem.heads_q} and batch={problem.batch} must each be "
                             f"at most {MAX_GRID_YZ} (CUDA grid limit)")
    tma = entry.launch.tma_q_rows > 0
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        tensor = getattr(tensors, name)
        _check_tensor(name, tensor if varlen is None else _map_tensor(tensor, 1),
                      tma and name in ("q", "k", "v", "dout"))
    return entry, grid, rows, scale


def attention_backward(bundle: Bundle, problem: Problem, tensors: BackwardTensors, *,
                       workspace: int, semaphores: int = 0, softmax_scale: float | None = None,
                       stream: int = 0, device: int = 0, entry: KernelEntry | None = None,
                       score_tensors: ScoreTensors = ScoreTensors(), varlen: Varlen | None = None) -> None:
    """dq, dk, dv of one attention: the three backward kernels (fagen/contract.py, "Backward
    kernels") on `stream`, asynchronous. `workspace`: a device buffer of
    backward_workspace(...).floats fp32; `semaphores`: 0, or a zeroed int32 buffer of
    backward_workspace(...).semaphores for the deterministic mode (the same gradients, bit
    for bit, on every run); `score_tensors`: the modifiers' arrays, and with sinks dsinks, which
    the backward writes (deterministic in either mode); `varlen`: the packing of a varlen
    problem. Raises like prepare(). fagen.runtime.prepared keeps all but the launch for calls
    of the same shapes."""
    entry, grid, rows, scale = _checked_backward(bundle, problem, tensors, bool(semaphores), softmax_scale, device,
                                                 entry, score_tensors, varlen)
    if not workspace:
        raise AttentionError("the backward needs a workspace (backward_workspace(...).floats fp32)")
    layout = backward_workspace(entry, problem, None if varlen is None else varlen.total_q)
    params = _bwd_params(problem, tensors, layout, workspace, semaphores, scale, softmax_scale, score_tensors,
                         varlen)
    extra = (bwd_tma_maps(problem, tensors, entry.launch, params.dq_accum, varlen),) if entry.launch.tma_q_rows else ()
    with driver.primary_context(device):
        bundle.kernel(entry).enqueue_backward(params, grid, rows, stream, device, extra)
