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
from .call import (AttentionError, Problem, ScoreTensors, Tensor, _check_entry, _check_score_tensors,
                   _check_tensor, check_problem, fwd_params)
from .loader import Bundle, LoadedKernel, launch_grid


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
        self.kernel.enqueue(params, self.grid, stream, self.device)
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
        block_n = entry.launch.block_n
        if cache.page_size <= 0 or cache.page_size % block_n:
            raise AttentionError(f"page_size={cache.page_size}: must be a positive multiple of {block_n} "
                                 f"(kernel {entry.name} reads {block_n} keys at a time, within one page)")
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
    entry = bundle.select(problem.key, driver.compute_capability(device), problem.seqlen_k)
    one_split = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                            problem.seqlen_k, problem.heads_kv)
    return _split_count(entry, problem, device, one_split)


def _split_count(entry: KernelEntry, problem: Problem, device: int, one_split: tuple[int, int, int]) -> int:
    """contract.split_count of a launch whose one-split grid is `one_split`."""
    return contract.split_count(one_split[1] * one_split[2], problem.seqlen_k,
                                driver.multiprocessor_count(device), entry.launch.min_split_keys)


def prepare_kvcache(bundle: Bundle, problem: Problem, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    cache: KvCache, softmax_scale: float | None = None, device: int = 0,
                    num_splits: int = 0, entry: KernelEntry | None = None,
                    score_tensors: ScoreTensors = ScoreTensors(),
                    new_keys: NewKeys | None = None) -> PreparedKvCacheAttention:
    """Check a paged-layout call (problem.layout == "paged"; seqlen_q: the longest row's query
    tokens, seqlen_k: the most keys a row may have, the cache's capacity), pick its kernel and
    split count (`num_splits` 0: contract.split_count; n: n) and build its launch; `new_keys`
    are appended into the cache first (the append entry point, same stream). Raises
    AttentionError, KernelNotFound, ScaleError like fagen.runtime.call.prepare."""
    if problem.layout != "paged":
        raise AttentionError(f"layout {problem.layout!r}: a KV-cache call has the paged layout")
    check_problem(problem)
    if problem.seqlen_k == 0:
        raise AttentionError("need a cache of at least one key per row (seqlen_k >= 1)")
    if problem.mask_mod is not None:
        raise AttentionError("the paged layout takes the built-in masks only (causal, window_size)")
    _check_score_tensors(problem, score_tensors)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= contract.MAX_SPLITS:
        raise AttentionError(f"num_splits={num_splits!r}: 0 (chosen from the shapes) or 1..{contract.MAX_SPLITS}")
    scale = contract.kernel_score_scale(softmax_scale, problem.head_dim, problem.score.softcap)
    entry = entry or bundle.select(problem.key, driver.compute_capability(device), problem.seqlen_k)
    _check_entry(entry, problem.key)
    _check_cache(problem, cache, entry)
    for name, tensor in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_tensor(name, tensor, False)
    if new_keys is not None:
        _check_new_keys(problem, cache, new_keys)
    one_split = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                            problem.seqlen_k, problem.heads_kv)
    if one_split[1] > MAX_GRID_YZ or one_split[2] > MAX_GRID_YZ:
        raise AttentionError(f"batch={problem.batch} and the query blocks x nheads_kv ({one_split[1]}) "
                             f"must each be at most {MAX_GRID_YZ} (CUDA grid limit)")
    if num_splits == 0:
        num_splits = _split_count(entry, problem, device, one_split)
    grid = launch_grid(entry, problem.seqlen_q, problem.heads_q, problem.batch, device,
                       problem.seqlen_k, problem.heads_kv, num_splits)
    params = fwd_params(problem, q, k, v, out, scale, score_tensors)
    if cache.cu_seqlens_q:
        params.lse_batch_stride, params.lse_head_stride = 0, cache.total_q
    params.cu_seqlens_q = cache.cu_seqlens_q or None
    params.seqused_k = cache.seqused_k or None
    params.block_table = cache.block_table or None
    params.block_table_batch_stride = cache.block_table_batch_stride
    params.page_size = cache.page_size
    params.pages = cache.pages
    params.num_splits = num_splits
    append_grid = None
    if new_keys is not None and new_keys.seqlen_new > 0:
        params.k_new, params.v_new, params.seqlen_new = new_keys.k.data, new_keys.v.data, new_keys.seqlen_new
        (params.k_new_batch_stride, params.k_new_row_stride, params.k_new_head_stride) = new_keys.k.strides
        (params.v_new_batch_stride, params.v_new_row_stride, params.v_new_head_stride) = new_keys.v.strides
        append_grid = contract.companion_grid(problem.batch, new_keys.seqlen_new, problem.heads_kv)
    workspace = contract.SplitWorkspace.of(num_splits, problem.batch, problem.seqlen_q, problem.heads_q,
                                           problem.value_dim)
    return PreparedKvCacheAttention(bundle.kernel(entry), grid,
                                    contract.companion_grid(problem.batch, problem.seqlen_q, problem.heads_q),
                                    append_grid, bytes(params), num_splits, workspace, device)


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
        _check_tensor(name, tensor, False)
