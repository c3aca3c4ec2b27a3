"""The contract between build and run: what the spec, the bundle writer, the Python runtime and
the C++ loader must agree on, defined once.

Standard library only (like ``abi.py``, the ctypes mirror of ``params.h``): the runtime imports
it on machines without pydantic, Jinja or NVRTC. The C++ side gets the same definitions as a
generated header, ``include/fagen/contract.h`` (fagen/bundle/contract_header.py), written into every
bundle beside ``index.h``.

- the kernel key: what a caller asks a bundle for (``fwd/bf16/hd128/causal``,
  ``fwd/bf16/hd128/local/paged``), format and parse;
- the mask rule: which mask kind and window sizes a call's ``causal`` and ``window_size`` mean;
- the shared limits the kernels' inputs must meet (head dims, alignment, strides, grid);
- the softmax-scale rule: which ``softmax_scale`` values the kernels answer correctly, and the
  ``scale_log2`` they are launched with (``fagen/softmax_scale.py``, re-exported here);
- the rule for paths a manifest names (normalised, relative, inside the bundle);
- the launch description of a kernel and its manifest entry (what the writer records and the
  loaders launch by), and the KV-cache calls' split and box rules (``fagen/kv_cache_contract.py``,
  re-exported here).
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from pathlib import PurePosixPath

# The KV-cache calls' launch rules (their own module for size; part of this contract).
from .kv_cache_contract import (  # noqa: F401
    CACHE_TMA_BOX_ROWS, COMPANION_ROWS_PER_CTA, COMPANION_THREADS, MAX_SPLITS, PAGE_SIZE_MULTIPLE,
    PAGED_TILE_MIN_QUERIES, SPLIT_APPEND_SUFFIX, SPLIT_COMBINE_SUFFIX, SPLIT_MERGE_SUFFIX, SPLIT_WAVE_FILL,
    SplitWorkspace, cache_box_rows, companion_grid, split_count,
)
# The softmax-scale rule (its own module for size; part of this contract).
from .softmax_scale import (  # noqa: F401
    LOG2_E, MIN_SCALE_LOG2, KernelScale, ScaleError, default_softmax_scale, kernel_scale_log2,
    kernel_score_scale,
)

# ---------------------------------------------------------------------------- kernel key

DIRECTIONS = ("fwd", "bwd")
# The element types of q, k and v. e4m3 (OCP FP8, torch.float8_e4m3fn) comes with descales
# (FagenFwdParams.q_descale ...) and writes its output in OUTPUT_DTYPES' type.
DTYPES = ("fp16", "bf16", "e4m3")
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "e4m3": 1}
# The output's element type where it is not the inputs' (flash-attn's FP8 forward returns bf16).
OUTPUT_DTYPES = {"e4m3": "bf16"}
# The element types a KV cache (the paged layout's k and v) may have besides its queries': an
# FP8 cache under fp16 or bf16 queries, which the split-KV kernels widen in registers (its
# descales are k's and v's, FagenFwdParams.k_descale ...). A key spells the pair as dtypes_name
# does; the output is the queries' type.
CACHE_DTYPES = ("e4m3",)
CACHE_DTYPE_SEPARATOR = "-"
# The built-in masks (templates/include/fagen/algo/mask.cuh: MaskKind), in its order: what a
# call's causal and window_size select (call_mask).
MASKS = ("full", "causal", "local")
# MaskKind's members: the built-in masks, then `custom`, the kind of every user mask (a spec's
# `masks:`), which a key spells by the user's name for it (custom_mask_name_problem).
MASK_KINDS = MASKS + ("custom",)
_CUSTOM_MASK_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# The score modifiers (templates/include/fagen/algo/score.cuh: softcap, ALiBi; the sinks of
# algo/online_softmax.cuh and the backward's algo/backward_rows.cuh), in the order a key spells
# them.
SCORE_MODS = ("softcap", "alibi", "sinks")
# How a call lays out its tensors: `dense` (flash_attn_func: q (batch, seqlen_q, ...), k and v
# (batch, seqlen_k, ...)), `paged` (flash_attn_with_kvcache: K/V in a cache, per batch row a
# length and either a contiguous block or pages through a block table; q dense or packed by
# cu_seqlens_q; FagenFwdParams' serving fields), `varlen` (flash_attn_varlen_func: q, k and v
# packed, (total, heads, head_dim), each batch row's tokens from cu_seqlens_q / cu_seqlens_k; the
# grid sized by the longest row; forward and backward). The first is every key's default.
LAYOUTS = ("dense", "paged", "varlen")
# The one spelling of a key; parse() and the generated C++ kernel_key() follow it. The dtype is
# q's, and the cache's after a `-` where it differs (dtypes_name: bf16, bf16-e4m3); the head
# dims are q and k's, and v's after a `v` where it differs (head_dims_name: 128, 192v128); the
# variant is the mask and the kernel's score modifiers, e.g. "local+softcap" (variant_name); a
# layout other than dense follows as a last part (fwd/bf16/hd128/local/paged).
KEY_FORMAT = "{direction}/{dtype}/hd{head_dims}/{variant}"
LAYOUT_SUFFIX = "/{layout}"
_KEY_FIELDS = {"direction": "[a-z]+", "dtype": "[a-z0-9]+(?:-[a-z0-9]+)?", "head_dims": "[0-9]+(?:v[0-9]+)?",
               "variant": "[a-z0-9_+]+", "layout": "[a-z]+"}


def _key_pattern(key_format: str) -> str:
    return "".join(re.escape(literal) + (f"(?P<{field}>{_KEY_FIELDS[field]})" if field else "")
                   for literal, field, _, _ in string.Formatter().parse(key_format))


_KEY = re.compile(f"^{_key_pattern(KEY_FORMAT)}(?:{_key_pattern(LAYOUT_SUFFIX)})?$")


def custom_mask_name_problem(name: object) -> str | None:
    """Why `name` cannot name a user's mask (in a spec's `masks:`, a key, a call), or None:
    lower case letters, digits and _, a letter first, and none of the built-in names."""
    if not isinstance(name, str) or not _CUSTOM_MASK_NAME.match(name):
        return f"mask name {name!r}: lower-case letters, digits and _, starting with a letter"
    if name in MASK_KINDS or name in SCORE_MODS or name == "none":
        return f"mask name {name!r}: taken by a built-in mask or score modifier"
    return None


def variant_name(mask: str, mods: tuple[str, ...] = ()) -> str:
    """The mask (a built-in one, or a user's mask by its name) and the score modifiers (in
    SCORE_MODS order) as a key spells them."""
    if mask not in MASKS and custom_mask_name_problem(mask):  # e.g. a causal flag
        raise ValueError(f"mask={mask!r}: one of {', '.join(MASKS)}, or a custom mask's name")
    unknown = [mod for mod in mods if mod not in SCORE_MODS]
    if unknown:
        raise ValueError(f"score modifiers {unknown}: each one of {', '.join(SCORE_MODS)}")
    return mask + "".join(f"+{mod}" for mod in SCORE_MODS if mod in mods)


def dtypes_name(dtype: str, kv_dtype: str | None = None) -> str:
    """q's element type, and the K/V cache's after a `-` where it differs (None: the same), as a
    key spells them: bf16, bf16-e4m3."""
    if kv_dtype is None or kv_dtype == dtype:
        return dtype
    return f"{dtype}{CACHE_DTYPE_SEPARATOR}{kv_dtype}"


def parse_dtypes(name: str) -> tuple[str, str]:
    """The (q, K/V) element types that dtypes_name spelled as `name`."""
    dtype, _, kv_dtype = name.partition(CACHE_DTYPE_SEPARATOR)
    return dtype, kv_dtype or dtype


def head_dims_name(head_dim: int, head_dim_v: int | None = None) -> str:
    """q/k's head dim, and v's after a `v` where it differs (None: the same), as a key spells
    them: 128, 192v128."""
    if head_dim_v is None or head_dim_v == head_dim:
        return str(head_dim)
    return f"{head_dim}v{head_dim_v}"


@dataclass(frozen=True)
class KernelKey:
    """What a call asks a bundle for, architecture aside; the loaders match it exactly."""

    direction: str
    dtype: str
    head_dim: int  # q's and k's
    mask: str  # one of MASKS, or a custom mask's name
    mods: tuple[str, ...] = ()  # of SCORE_MODS, in its order
    head_dim_v: int | None = None  # v's and the output's where it differs from head_dim
    layout: str = LAYOUTS[0]
    kv_dtype: str | None = None  # the K/V cache's element type where it differs from dtype

    def __post_init__(self):
        if self.head_dim_v == self.head_dim:  # one head dim: spelled once
            object.__setattr__(self, "head_dim_v", None)
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", None)

    def __str__(self) -> str:
        return kernel_key(self.direction, self.dtype, self.head_dim, self.mask, self.mods, self.head_dim_v,
                          self.layout, self.kv_dtype)

    @classmethod
    def parse(cls, text: str) -> "KernelKey | None":
        """The key `text` spells, or None when it has another shape."""
        found = _KEY.match(text)
        if found is None:
            return None
        mask, *mods = found["variant"].split("+")
        if mask not in MASKS and custom_mask_name_problem(mask):
            return None
        if tuple(mods) != tuple(m for m in SCORE_MODS if m in mods):
            return None
        head_dim, _, head_dim_v = found["head_dims"].partition("v")
        if head_dim_v == head_dim:  # spelled once where they agree
            return None
        layout = found["layout"] or LAYOUTS[0]
        if layout not in LAYOUTS or found["layout"] == LAYOUTS[0]:  # dense is never spelled
            return None
        dtype, kv_dtype = parse_dtypes(found["dtype"])
        if CACHE_DTYPE_SEPARATOR in found["dtype"] and kv_dtype == dtype:  # spelled once where they agree
            return None
        return cls(found["direction"], dtype, int(head_dim), mask, tuple(mods),
                   int(head_dim_v) if head_dim_v else None, layout, kv_dtype)


def kernel_key(direction: str, dtype: str, head_dim: int, mask: str, mods: tuple[str, ...] = (),
               head_dim_v: int | None = None, layout: str = LAYOUTS[0], kv_dtype: str | None = None) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {', '.join(LAYOUTS)}")
    key = KEY_FORMAT.format(direction=direction, dtype=dtypes_name(dtype, kv_dtype),
                            head_dims=head_dims_name(head_dim, head_dim_v),
                            variant=variant_name(mask, mods))
    return key if layout == LAYOUTS[0] else key + LAYOUT_SUFFIX.format(layout=layout)


# ---------------------------------------------------------------------------- mask rule


class MaskError(ValueError):
    """A window_size the kernels cannot take."""


@dataclass(frozen=True)
class Mask:
    """The mask of one call: its kind (MASKS) and the window sizes the kernels are launched with
    (FagenFwdParams / FagenBwdParams window_left, window_right; >= 0, an unbounded edge as
    seqlen_q + seqlen_k, past every key; 0 where the kind has no such edge)."""

    kind: str
    window_left: int = 0
    window_right: int = 0


def call_mask(causal: bool, window_size: tuple[int, int], seqlen_q: int, seqlen_k: int) -> Mask:
    """flash-attn's rule for `causal` and `window_size` = (left, right): query row i sees keys j
    with i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 is unbounded,
    and so is a size >= seqlen_k, or a left size >= seqlen_k - 1 (the last row's window then
    starts at key 0 already: Mistral's 4095 over 4096 keys is the causal mask); causal sets
    right = 0. Which kind of kernel serves the result:
    no edge is `full`, right = 0 alone is `causal`, anything else `local`. Raises MaskError for
    sizes below -1. Mirrored by fagen.hpp's call_mask."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise MaskError(f"window_size={window_size!r}: must be a pair of ints (left, right)") from None
    if left < -1 or right < -1:
        raise MaskError(f"window_size={window_size!r}: each size must be >= 0, or -1 for unbounded")
    left = -1 if left >= seqlen_k - 1 else left
    right = -1 if right >= seqlen_k else right
    if causal:
        right = 0
    if left < 0 and right < 0:
        return Mask("full")
    if left < 0 and right == 0:
        return Mask("causal")
    unbounded = seqlen_q + seqlen_k
    return Mask("local", unbounded if left < 0 else left, unbounded if right < 0 else right)


def banded(mask: Mask, seqlen_q: int, seqlen_k: int) -> Mask:
    """A built-in mask as the band a local kernel takes (the paged layout's kernels take every
    built-in mask so): full is both edges unbounded, causal the right edge at 0."""
    if mask.kind == "local":
        return mask
    if mask.kind not in MASKS:
        raise MaskError(f"mask {mask.kind!r}: a built-in mask ({', '.join(MASKS)}) has no band")
    unbounded = seqlen_q + seqlen_k
    return Mask("local", unbounded, 0 if mask.kind == "causal" else unbounded)


# ---------------------------------------------------------------------------- score rule


class ScoreError(ValueError):
    """A softcap, ALiBi slopes or sinks the kernels cannot take."""


@dataclass(frozen=True)
class Score:
    """The score modifiers of one call (flash-attn's names): `softcap` > 0 caps the scaled
    scores at softcap * tanh(score / softcap) (0: none); `alibi`: ALiBi slopes are given;
    `sinks`: a learnable sink logit per query head joins each row's softmax."""

    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    def __post_init__(self):
        softcap = float(self.softcap)
        if math.isnan(softcap) or math.isinf(softcap) or softcap < 0:
            raise ScoreError(f"softcap={self.softcap}: must be a finite number >= 0 (0: no softcap)")

    @property
    def mods(self) -> tuple[str, ...]:
        """The kernel's score modifiers (SCORE_MODS) this call needs."""
        flags = {"softcap": self.softcap > 0, "alibi": self.alibi, "sinks": self.sinks}
        return tuple(mod for mod in SCORE_MODS if flags[mod])


# ---------------------------------------------------------------------------- shared limits

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # 16-byte vectors of fp16/bf16
ALIGNMENT_BYTES = 16  # every row start: the kernels move 16-byte vectors
STRIDE_MULTIPLE = 8  # batch/row/head strides, in elements (16 bytes of fp16/bf16)
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (heads, batch)
TMA_BOX_BYTES = 128  # a box row is one 128-byte swizzle row, whatever the element


def output_dtype(dtype: str) -> str:
    """The element type a forward with inputs of `dtype` writes its output in."""
    return OUTPUT_DTYPES.get(dtype, dtype)


def stride_multiple(dtype: str) -> int:
    """Strides of a tensor of `dtype`, in elements, are multiples of this (16 bytes)."""
    return ALIGNMENT_BYTES // DTYPE_BYTES[dtype]


def tma_box_columns(dtype: str) -> int:
    """Columns of a FagenTmaMaps box of `dtype` (128 bytes: 64 fp16/bf16, 128 e4m3)."""
    return TMA_BOX_BYTES // DTYPE_BYTES[dtype]
# FagenBwdTmaMaps.dq_accum: fp32, so a 128-byte swizzle row is 32 columns.
ACCUM_BYTES = 4
ACCUM_BOX_COLUMNS = 32


def head_dim_problem(head_dim: int, name: str = "head_dim") -> str | None:
    """Why no fagen kernel can take `head_dim` (q/k's, or v's as `name` says), or None."""
    if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
        return (f"{name}={head_dim}: must be a multiple of {HEAD_DIM_MULTIPLE} in "
                f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]")
    return None


# ---------------------------------------------------------------------------- manifest paths


def path_problem(path: object) -> str | None:
    """Why `path` (a file named by a manifest) is not a normalised relative path inside the
    bundle, or None. Says nothing about what the path points to."""
    if not isinstance(path, str) or not path:
        return "not a path"
    pure = PurePosixPath(path)
    if "\\" in path or "\0" in path or pure.is_absolute() or pure.as_posix() != path:
        return "not a normalised relative path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "not a normalised relative path"
    return None


# ---------------------------------------------------------------------------- launch and entry

# The shapes of a launch's grid (Launch.grid); index.h stores the position in this tuple.
#   tiles:      (ceil(seqlen_q / block_m), heads_q, batch), one query block per CTA
#   persistent: (min(query blocks * heads_q * batch, SMs), 1, 1), each CTA walks many tiles
#   heads:      (heads_q, batch, 1), one CTA walks every block of a head (FA1)
#   key_blocks: (ceil(seqlen_k / block_n), heads_kv, batch), one key block per CTA, which walks
#               every query block of the query heads its K/V head serves (backward)
#   splits:     (num_splits, packed query blocks * heads_kv, batch): the query rows of one K/V
#               head (its query heads' rows side by side, seqlen_q * heads_q / heads_kv of them)
#               in blocks of block_m, and the keys in num_splits ranges (split_count)
GRIDS = ("tiles", "persistent", "heads", "key_blocks", "splits")

# Backward kernels: one cubin, three entry points run in this order on one stream. The
# preprocess kernel (<name>_preprocess) fills the workspace (rowsum(dO * O), LSE in base 2,
# dQ's accumulator zeroed), the main kernel (<name>) computes dK and dV and accumulates dQ, the
# conversion (<name>_dq) writes dQ. The first and the last walk the query rows:
# grid (ceil(seqlen_q / BWD_ROWS_PER_CTA), heads_q, batch), BWD_ROW_THREADS threads, no
# dynamic shared memory.
BWD_PREPROCESS_SUFFIX = "_preprocess"
BWD_CONVERT_SUFFIX = "_dq"
BWD_ROWS_PER_CTA = 64  # 4 warps, a row each at a time: 16 rows per warp
BWD_ROW_THREADS = 128


# e4m3 forwards: one cubin, two entry points run in this order on one stream. 8-bit wgmma takes
# its B operand K-major only, so P V reads V^T: the companion (<name>_vt) writes the call's V as
# V^T into the workspace (templates/include/fagen/algo/v_transpose.cuh: (batch, heads_kv,
# head_dim_v, vt_keys(seqlen_k)), keys permuted within each 16), on grid vt_grid with
# vt_threads(head_dim_v) threads (one per 16 keys by 16 columns), no dynamic shared memory; the
# forward's V map (FagenTmaMaps.v) is over that V^T: (vt_keys, head_dim_v, heads_kv, batch),
# boxes of 128 keys by head_dim_v rows.
E4M3_VT_SUFFIX = "_vt"
VT_KEY_GROUP = 16  # keys permuted together; a V^T row is whole groups (16 bytes)
VT_KEYS_PER_CTA = 128
VT_COLUMNS_PER_THREAD = 16


def vt_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // VT_KEY_GROUP) * VT_KEY_GROUP


def vt_workspace_bytes(batch: int, heads_kv: int, head_dim_v: int, seqlen_k: int) -> int:
    return batch * heads_kv * head_dim_v * vt_keys(seqlen_k)


def vt_grid(seqlen_k: int, heads_kv: int, batch: int) -> tuple[int, int, int]:
    return (-(-seqlen_k // VT_KEYS_PER_CTA), heads_kv, batch)


def vt_threads(head_dim_v: int) -> int:
    return VT_KEYS_PER_CTA // VT_KEY_GROUP * (head_dim_v // VT_COLUMNS_PER_THREAD)


# The dQ accumulator's rows per (batch, head) are padded to a multiple of this: the FA2
# backward adds it in whole 16 x 8 fragment tiles (templates/include/fagen/algo/backward_rows.cuh),
# the last of which would otherwise reach into the next head's rows.
DQ_ACCUM_ROW_ALIGN = 16


# The preprocess sums dL/dsink per warp of 16 query rows (templates/include/fagen/algo/
# backward_rows.cuh); the dQ conversion adds those partials up.
SINK_PARTIAL_ROWS = 16


def dq_accum_rows(seqlen_q: int) -> int:
    return -(-seqlen_q // DQ_ACCUM_ROW_ALIGN) * DQ_ACCUM_ROW_ALIGN


# A varlen forward on a persistent grid walks its tiles in a static order, which mixed lengths
# unbalance; launched with a CTA per work item instead, the hardware hands tiles to SMs as they
# free up. Decided on the host from the shapes alone (no sync): lengths count as mixed when the
# grid's rows (batch x the longest) exceed the real ones by this factor. bench.varlen, 2026-12-02
# (docs/performance.md, entry 128): one item per CTA ran mixed lengths (seqlen/8 ... seqlen: rows
# ~1.8x the real ones) at 0.57-0.98x the dense TFLOP/s against 0.52-0.95x, equal lengths (1.0x)
# at 0.91-0.94x against 0.92-1.00x at 4k.
VARLEN_MIXED_ROWS = 1.25


def varlen_walks_items(batch: int, max_seqlen_q: int, total_q: int) -> bool:
    """Whether a varlen forward on a persistent grid is launched with one CTA per work item."""
    return batch * max_seqlen_q > VARLEN_MIXED_ROWS * max(total_q, 1)


def varlen_accum_rows(total_q: int, batch: int) -> int:
    """The varlen layout's dQ accumulator rows per head: batch row b's rows start at
    varlen_accum_begin(cu_seqlens_q[b], b), a multiple of DQ_ACCUM_ROW_ALIGN (the FA2 backward adds
    whole 16-row tiles), which leaves each row its rows padded to the alignment."""
    return dq_accum_rows(total_q) + DQ_ACCUM_ROW_ALIGN * batch


def varlen_accum_begin(q_begin: int, batch_row: int) -> int:
    return (q_begin + DQ_ACCUM_ROW_ALIGN * batch_row) // DQ_ACCUM_ROW_ALIGN * DQ_ACCUM_ROW_ALIGN


def bwd_row_grid(seqlen_q: int, heads_q: int, batch: int) -> tuple[int, int, int]:
    return (-(-seqlen_q // BWD_ROWS_PER_CTA), heads_q, batch)


@dataclass(frozen=True)
class BackwardWorkspace:
    """The fp32 arrays a backward call needs beside its outputs, as float offsets into one
    buffer (FagenBwdParams: dq_accum, softmax_d, lse_log2), and the int32 semaphores of the
    deterministic mode (their own, zeroed buffer: one per query block of the main kernel).
    The dQ accumulator holds dq_accum_rows(seqlen_q) rows of head_dim floats per (batch,
    head); softmax_d and lse_log2 one float per query row; sink_partials (FagenBwdParams, read
    by kernels with sinks) one float per SINK_PARTIAL_ROWS query rows of each (batch, head)."""

    dq_accum: int
    softmax_d: int
    lse_log2: int
    sink_partials: int
    floats: int
    semaphores: int

    @classmethod
    def of(cls, batch: int, heads_q: int, seqlen_q: int, head_dim: int,
           block_m: int) -> "BackwardWorkspace":
        rows = batch * heads_q * seqlen_q
        accum = batch * heads_q * dq_accum_rows(seqlen_q) * head_dim
        partials = batch * heads_q * -(-seqlen_q // SINK_PARTIAL_ROWS)
        return cls(dq_accum=0, softmax_d=accum, lse_log2=accum + rows, sink_partials=accum + 2 * rows,
                   floats=accum + 2 * rows + partials, semaphores=batch * heads_q * -(-seqlen_q // block_m))

    @classmethod
    def varlen(cls, batch: int, heads_q: int, total_q: int, max_seqlen_q: int, head_dim: int,
               block_m: int) -> "BackwardWorkspace":
        """The varlen layout's (FagenBwdParams: cu_seqlens_q): softmax_d and lse_log2 of the packed
        rows, (heads_q, total_q) like its LSE; the accumulator varlen_accum_rows per head; sink
        partials and semaphores per (batch row, head) as of(batch, ..., max_seqlen_q)."""
        rows = heads_q * total_q
        accum = heads_q * varlen_accum_rows(total_q, batch) * head_dim
        partials = batch * heads_q * -(-max_seqlen_q // SINK_PARTIAL_ROWS)
        return cls(dq_accum=0, softmax_d=accum, lse_log2=accum + rows, sink_partials=accum + 2 * rows,
                   floats=accum + 2 * rows + partials,
                   semaphores=batch * heads_q * -(-max_seqlen_q // block_m))


@dataclass(frozen=True)
class Launch:
    """How a host launches a kernel: block, grid (GRIDS) and the parameters after FagenFwdParams
    (FagenBwdParams for a backward's main kernel): FagenTmaMaps (FagenBwdTmaMaps) when
    tma_q_rows > 0 (box rows of the Q (and dO, dQ accumulator) and K/V maps, 64 columns (32 of
    the fp32 accumulator), 128-byte swizzle), then a float* workspace of
    workspace_floats_per_row floats per query row (of every head and batch) when that is > 0."""

    threads: int
    block_m: int
    dynamic_smem: int
    grid: str = "tiles"
    tma_q_rows: int = 0
    tma_kv_rows: int = 0
    workspace_floats_per_row: int = 0
    block_n: int = 0  # keys per CTA of a key_blocks grid
    min_split_keys: int = 0  # a splits grid: the fewest keys worth a split (split_count)

    @classmethod
    def from_dict(cls, d: dict) -> "Launch":
        d = dict(d)
        if "grid" not in d:  # schemas 1-2: persistent (and ctas_per_sm, now always 1)
            d["grid"] = GRIDS[1] if d.pop("persistent", False) else GRIDS[0]
            d.pop("ctas_per_sm", None)
        if d["grid"] not in GRIDS:
            raise ValueError(f"launch.grid {d['grid']!r} is not one of {', '.join(GRIDS)}")
        return cls(**d)

    def grid_dims(self, seqlen_q: int, heads_q: int, batch: int, multiprocessors: int,
                  seqlen_k: int = 0, heads_kv: int = 0, num_splits: int = 1) -> tuple[int, int, int]:
        m_blocks = -(-seqlen_q // self.block_m)
        if self.grid == "persistent":
            return (min(m_blocks * heads_q * batch, multiprocessors), 1, 1)
        if self.grid == "heads":
            return (heads_q, batch, 1)
        if self.grid == "key_blocks":
            return (-(-seqlen_k // self.block_n), heads_kv, batch)
        if self.grid == "splits":
            packed_blocks = -(-seqlen_q * (heads_q // heads_kv) // self.block_m)
            return (num_splits, packed_blocks * heads_kv, batch)
        return (m_blocks, heads_q, batch)

    def workspace_floats(self, seqlen_q: int, heads_q: int, batch: int) -> int:
        return self.workspace_floats_per_row * seqlen_q * heads_q * batch


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int
    stack_bytes: int
    static_smem: int


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of a bundle, as its manifest records it."""

    name: str  # == the extern "C" symbol
    key: str  # KernelKey, e.g. "fwd/bf16/hd128/causal"
    arch: str  # e.g. "sm90", "sm90a"
    compute_capability: tuple[int, int]
    arch_specific: bool
    fa_version: int
    spec: dict
    cubin: str  # path relative to the bundle root (path_problem)
    source: str
    sha256: str
    size: int
    launch: Launch
    resources: Resources
    sass: tuple[str, ...]
    # Preferred for calls with at most this many keys (fagen.runtime.loader.select); None:
    # any length. Schema-1 manifests have no such field: every kernel unbounded.
    max_seqlen_k: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "KernelEntry":
        return cls(
            **{
                **d,
                "compute_capability": tuple(d["compute_capability"]),
                "launch": Launch.from_dict(d["launch"]),
                "resources": Resources(**d["resources"]),
                "sass": tuple(d["sass"]),
            }
        )
