"""Attention over a KV cache, no torch: the paged layout (contract.LAYOUTS), flash-attn's
``flash_attn_with_kvcache`` and vLLM's paged varlen call on device pointers.

q holds each batch row's new query tokens, dense (batch, seqlen_q, heads_q, head_dim) or packed
(total_q, heads_q, head_dim) by cu_seqlens_q; k and v hold the cache, per batch row either a
contiguous block (batch, capacity, heads_kv, head_dim) or pages (pages, page_size, heads_kv,
head_dim) named by a block table; each row's length (seqused_k, flash-attn's cache_seqlens) is
read on the device. Nothing here reads device memory or allocates: a prepared launch can be
captured in a CUDA graph and replayed with new cache contents, lengths and block tables, since
its grid and split count depend on the shapes alone (contract.split_count).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import contract
from ..abi import FwdParams
from ..contract import MAX_GRID_YZ, KernelEntry
from . import driver
from .call import (AttentionError, Problem, ScoreTensors, Tensor, _blob_array, _check_descales, _check_entry,
                   _check_score_tensors, _check_tensor, _map_tensor, _tensor_map, check_problem, fwd_params)
from .e4m3 import Descales
from .loader import Bundle, KernelNotFound, LoadedKernel, launch_grid

# The algorithms of the paged layout's kernels: the split-KV decode kernels (grid `splits`,
# fagen/model/fa2_split_kv.py) and the tile kernels of a prefill (the paged layout of FA4 on
# sm100a and FA3 on sm90a, fagen/model/fa4.py and fa3.py; a device has one of them), which
# contract.PAGED_TILE_MIN_QUERIES chooses between.
SPLIT_KV_FA_VERSION = 2
TILE_FA_VERSIONS = (4, 3)


@dataclass(frozen=True)
class KvCache:
    """The cache side of a paged-layout call (FagenFwdParams' serving fields) as device
    addresses (0: not given). seqused_k: int32 (batch,), each row's keys (at most the problem's
    seqlen_k); without it every row has seqlen_k. block_table: int32, row b's pages at
    block_table + 4 * b * block_table_batch_stride; k and v are then (pages, page_size, heads_kv,
    head_dim) and their Tensor batch strides a page's. cu_seqlens_q: int32 (batch + 1) when q and
    out are packed (total_q rows; their Tensor batch strides 0)."""

    seqused_k: int = 0
    block_table: int = 0
    block_table_batch_stride: int = 0
    page_size: int = 0
    pages: int = 0
    cu_seqlens_q: int = 0
    total_q: int = 0  # packed q's rows (the LSE is then (heads_q, total_q))


@dataclass(frozen=True)
class NewKeys:
    """A call's new keys and values, (batch, seqlen_new, heads_kv, head_dim) like the cache's
    rows: the kernel's append entry point writes them into the cache at each row's length
    (KvCache.seqused_k, which stays the lengths before the append) before the attention, which
    then sees seqused_k + seqlen_new keys per row (flash-attn's k, v of flash_attn_with_kvcache)."""

    k: Tensor
    v: Tensor
    seqlen_new: int


@dataclass(frozen=True)
class PreparedKvCacheAttention:
    """A checked, selected and parameterised paged-layout launch; ``enqueue`` adds the output
    and workspace addresses."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    companion_grid: tuple[int, int, int]  # the combine's
    append_grid: tuple[int, int, int] | None  # None: no new keys
    params: bytes  # FagenFwdParams with o = lse = o_partial = lse_partial = 0
    num_splits: int
    workspace: contract.SplitWorkspace
    device: int
    extra_params: tuple = ()  # a tile kernel's FagenTmaMaps

    @property
    def workspace_bytes(self) -> int:
        return 4 * self.workspace.floats

    def enqueue(self, out: int, lse: int, stream: int, workspace: int = 0) -> None:
        """Launch on `stream` (the device's primary context current): the append when the call
        brings new keys, the split-KV kernel, then its combine when the keys are split.
        `workspace`: workspace_bytes of device memory."""
        params = FwdParams.from_buffer_copy(self.params)
        params.o, params.lse = out, lse
        if self.num_splits > 1:
            if not workspace:
                raise AttentionError(f"{self.num_splits} splits need a workspace of {self.workspace_bytes} bytes")
            params.o_partial = workspace + 4 * self.workspace.o_partial
            params.lse_partial = workspace + 4 * self.workspace.lse_partial
        self.enqueue_append(stream)
        self.kernel.enqueue(params, self.grid, stream, self.device, self.extra_params)
        if self.num_splits > 1:
            self.kernel.enqueue_companion(contract.SPLIT_COMBINE_SUFFIX, params, self.companion_grid,
                                          contract.COMPANION_THREADS, stream)

    def enqueue_append(self, stream: int) -> None:
        """The append alone (enqueue runs it first): the new keys and values into the cache."""
        if self.append_grid is not None:
            self.kernel.enqueue_companion(contract.SPLIT_APPEND_SUFFIX, FwdParams.from_buffer_copy(self.params),
                                          self.append_grid, contract.COMPANION_THREADS, stream)

    def launch(self, out: int, lse: int, stream: int, workspace: int = 0) -> None:
        with driver.primary_context(self.device):
            self.enqueue(out, lse, stream, workspace)


def _check_cache(problem: Problem, cache: KvCache, entry: KernelEntry) -> None:
    for name in ("seqused_k", "block_table", "cu_seqlens_q"):
        if getattr(cache, name) % 4:
            raise AttentionError(f"{name}: an int32 device array, 4-byte aligned")
    if cache.block_table:
        multiple = contract.PAGE_SIZE_MULTIPLE
        if cache.page_size <= 0 or cache.page_size % multiple:
            raise AttentionError(f"page_size={cache.page_size}: must be a positive multiple of {multiple} "
                                 f"(kernel {entry.name} reads runs of {multiple} keys, each within one page)")
        if cache.pages <= 0:
            raise AttentionError(f"pages={cache.pages}: the cache needs at least one page")
        if cache.block_table_batch_stride * cache.page_size < problem.seqlen_k:
            raise AttentionError(
                f"the block table's rows ({cache.block_table_batch_stride} entries of {cache.page_size} "
                f"keys) hold fewer than seqlen_k={problem.seqlen_k} keys")
    if cache.cu_seqlens_q and cache.total_q < 0:
        raise AttentionError(f"total_q={cache.total_q}: packed q's row count")


def split_count_for(bundle: Bundle, problem: Problem, device: int = 0) -> int:
    """The split count a paged-layout call of `problem` gets with num_splits=0: from its shapes
    and the device's SMs alone (contract.split_count), so one decided before a CUDA graph's
    capture holds for every replay (flash-attn's get_scheduler_metadata)."""
    check_problem(problem)
    entry = select_kvcache(bundle, problem, device)
    if entry.launch.grid != "splits":
        return 1
    one_split = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                            problem.seqlen_k, problem.heads_kv)
    return _split_count(entry, problem, device, one_split)


def select_kvcache(bundle: Bundle, problem: Problem, device: int = 0, num_splits: int = 0) -> KernelEntry:
    """The kernel of a paged-layout call: a prefill (seqlen_q >= contract.PAGED_TILE_MIN_QUERIES,
    not asked for splits) prefers a tile kernel, anything else the split-KV kernels; either
    takes the other algorithm's kernel where the bundle has only that."""
    capability = driver.compute_capability(device)
    prefill = problem.seqlen_q >= contract.PAGED_TILE_MIN_QUERIES and num_splits <= 1
    order = (*TILE_FA_VERSIONS, SPLIT_KV_FA_VERSION) if prefill else (SPLIT_KV_FA_VERSION, *TILE_FA_VERSIONS)
    for fa_version in order:
        try:
            return bundle.select(problem.key, capability, problem.seqlen_k, fa_version=fa_version)
        except KernelNotFound:
            pass
    return bundle.select(problem.key, capability, problem.seqlen_k)  # raises, saying what the bundle holds


def _split_count(entry: KernelEntry, problem: Problem, device: int, one_split: tuple[int, int, int]) -> int:
    """contract.split_count of a launch whose one-split grid is `one_split`."""
    return contract.split_count(one_split[1] * one_split[2], problem.seqlen_k,
                                driver.multiprocessor_count(device), entry.launch.min_split_keys)


def prepare_kvcache(bundle: Bundle, problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    cache: KvCache, softmax_scale: float | None = None, device: int = 0,
                    num_splits: int = 0, entry: KernelEntry | None = None,
                    score_tensors: ScoreTensors = ScoreTensors(),
                    new_keys: NewKeys | None = None, descales: Descales | None = None) -> PreparedKvCacheAttention:
    """Check a paged-layout call (problem.layout == "paged"; seqlen_q: the longest row's query
    tokens, seqlen_k: the most keys a row may have, the cache's capacity), pick its kernel and
    split count (`num_splits` 0: contract.split_count; n: n) and build its launch; `new_keys`
    (of the cache's element type) are appended into the cache first (the append entry point,
    same stream); `descales`: an e4m3 cache's (problem.kv_dtype; None: 1.0). Raises
    AttentionError, KernelNotFound, ScaleError like fagen.runtime.call.prepare."""
    if problem.layout != "paged":
        raise AttentionError(f"layout {problem.layout!r}: a KV-cache call has the paged layout")
    check_problem(problem)
    if problem.seqlen_k == 0:
        raise AttentionError("need a cache of at least one key per row (seqlen_k >= 1)")
    if problem.mask_mod is not None:
        raise AttentionError("the paged layout takes the built-in masks only (causal, window_size)")
    _check_score_tensors(problem, score_tensors)
    _check_descales(problem, descales)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= contract.MAX_SPLITS:
        raise AttentionError(f"num_splits={num_splits!r}: 0 (chosen from the shapes) or 1..{contract.MAX_SPLITS}")
    scale = contract.kernel_score_scale(softmax_scale, problem.head_dim, problem.score.softcap)
    entry = entry or select_kvcache(bundle, problem, device, num_splits)
    _check_entry(entry, problem.key)
    _check_cache(problem, cache, entry)
    tiles = entry.launch.grid != "splits"
    dtypes = {"q": problem.dtype, "k": problem.cache_dtype, "v": problem.cache_dtype,
              "out": contract.output_dtype(problem.dtype)}
    for name, tensor in (("q", q), ("k", k), ("v", v), ("out", out)):
        packed = cache.cu_seqlens_q and name in ("q", "out")
        _check_tensor(name, _map_tensor(tensor, cache.total_q) if packed else tensor, tiles and name != "out",
                      dtypes[name])
    if new_keys is not None:
        _check_new_keys(problem, cache, new_keys)
    if tiles:
        return _prepare_tiles(bundle, entry, problem, q, k, v, out, cache, scale, device, score_tensors, new_keys)
    one_split = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                            problem.seqlen_k, problem.heads_kv)
    if one_split[1] > MAX_GRID_YZ or one_split[2] > MAX_GRID_YZ:
        raise AttentionError(f"batch={problem.batch} and the query blocks x nheads_kv ({one_split[1]}) "
                             f"must each be at most {MAX_GRID_YZ} (CUDA grid limit)")
    if num_splits == 0:
        num_splits = _split_count(entry, problem, device, one_split)
    grid = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                       problem.seqlen_k, problem.heads_kv, num_splits)
    params, append_grid = _serving_params(problem, q, k, v, out, cache, scale, score_tensors, new_keys, descales)
    params.num_splits = num_splits
    workspace = contract.SplitWorkspace.of(num_splits, problem.batch, problem.seqlen_q, problem.heads_q,
                                           problem.value_dim)
    return PreparedKvCacheAttention(bundle.kernel(entry), grid,
                                    contract.companion_grid(problem.batch, problem.seqlen_q, problem.heads_q),
                                    append_grid, bytes(params), num_splits, workspace, device)


def _serving_params(problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor, cache: KvCache,
                    scale: contract.KernelScale, score_tensors: ScoreTensors,
                    new_keys: NewKeys | None, descales: Descales | None = None,
                    ) -> tuple[FwdParams, tuple[int, int, int] | None]:
    """FagenFwdParams of a paged-layout call (one split), and the append's grid (None: no new keys)."""
    params = fwd_params(problem, q, k, v, out, scale, score_tensors, descales=descales)
    if cache.cu_seqlens_q:
        params.q_batch_stride = params.o_batch_stride = 0
        params.lse_batch_stride, params.lse_head_stride = 0, cache.total_q
    params.cu_seqlens_q = cache.cu_seqlens_q or None
    params.seqused_k = cache.seqused_k or None
    params.block_table = cache.block_table or None
    params.block_table_batch_stride = cache.block_table_batch_stride
    params.page_size = cache.page_size
    params.pages = cache.pages
    params.num_splits = 1
    append_grid = None
    if new_keys is not None and new_keys.seqlen_new > 0:
        params.k_new, params.v_new, params.seqlen_new = new_keys.k.data, new_keys.v.data, new_keys.seqlen_new
        (params.k_new_batch_stride, params.k_new_row_stride, params.k_new_head_stride) = new_keys.k.strides
        (params.v_new_batch_stride, params.v_new_row_stride, params.v_new_head_stride) = new_keys.v.strides
        append_grid = contract.companion_grid(problem.batch, new_keys.seqlen_new, problem.heads_kv)
    return params, append_grid


def _prepare_tiles(bundle: Bundle, entry: KernelEntry, problem: Problem, q: Tensor, k: Tensor, v: Tensor,
                   out: Tensor, cache: KvCache, scale: contract.KernelScale, device: int,
                   score_tensors: ScoreTensors, new_keys: NewKeys | None) -> PreparedKvCacheAttention:
    """A paged-layout call on a tile kernel (FA4 or FA3, fa4/forward.cuh and fa3/forward.cuh:
    kPaged): its grid (FA3's persistent one: a CTA per work item for packed rows of mixed
    lengths, as a varlen call's; FA4's a CTA per tile),
    Q's map over dense or packed q, K's and V's over the pages (page_size rows, pages batch rows)
    or the contiguous cache, in boxes of the runs of keys the kernel loads (contract.cache_box_rows)."""
    p = problem
    grid = launch_grid(entry, p.seqlen_q, p.heads_q, p.batch, device)
    if cache.cu_seqlens_q and contract.varlen_walks_items(p.batch, p.seqlen_q, cache.total_q):
        grid = entry.launch.grid_dims(p.seqlen_q, p.heads_q, p.batch, 1 << 31)
    if grid[0] == 0:
        raise AttentionError("a KV-cache call needs seqlen_q, heads and batch >= 1")
    params, append_grid = _serving_params(p, q, k, v, out, cache, scale, score_tensors, new_keys)
    q_rows, q_batch = (max(cache.total_q, 1), 1) if cache.cu_seqlens_q else (p.seqlen_q, p.batch)
    kv_rows, kv_batch = (cache.page_size, cache.pages) if cache.block_table else (p.seqlen_k, p.batch)
    box = contract.cache_box_rows(cache.page_size if cache.block_table else 0, entry.launch.tma_kv_rows)
    maps = _blob_array(b"".join((
        _tensor_map(p.dtype, _map_tensor(q, q_rows) if cache.cu_seqlens_q else q, q_rows, p.heads_q, q_batch,
                    p.head_dim, entry.launch.tma_q_rows),
        _tensor_map(p.dtype, k, kv_rows, p.heads_kv, kv_batch, p.head_dim, box),
        _tensor_map(p.dtype, v, kv_rows, p.heads_kv, kv_batch, p.value_dim, box),
    )))
    return PreparedKvCacheAttention(bundle.kernel(entry), grid, (0, 0, 0), append_grid, bytes(params), 1,
                                    contract.SplitWorkspace.of(1, p.batch, p.seqlen_q, p.heads_q, p.value_dim),
                                    device, (maps,))


def _check_new_keys(problem: Problem, cache: KvCache, new_keys: NewKeys) -> None:
    if isinstance(new_keys.seqlen_new, bool) or not isinstance(new_keys.seqlen_new, int) or new_keys.seqlen_new < 0:
        raise AttentionError(f"seqlen_new={new_keys.seqlen_new!r}: the new keys per row, >= 0")
    if new_keys.seqlen_new and not cache.seqused_k:
        raise AttentionError("appending keys needs seqused_k (cache_seqlens: where each row's new keys go)")
    if cache.cu_seqlens_q:
        raise AttentionError("appending keys takes dense q (batch, seqlen_q, ...), not packed rows")
    if new_keys.seqlen_new > problem.seqlen_k:
        raise AttentionError(f"seqlen_new={new_keys.seqlen_new} new keys do not fit a cache of seqlen_k="
                             f"{problem.seqlen_k} keys per row")
    for name, tensor in (("k_new", new_keys.k), ("v_new", new_keys.v)):
        _check_tensor(name, tensor, False, problem.cache_dtype)
