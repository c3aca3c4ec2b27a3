"""The KV-cache calls' part of the contract (fagen/contract.py re-exports it): the split-KV
kernels' companion entry points, their split count and workspace, and which kernels a prefill
takes and how their K/V boxes follow the pages. Standard library only, like contract.py;
mirrored into contract.h (fagen/bundle/contract_header.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Split-KV kernels (grid `splits`) carry three more entry points, each a warp per (batch row,
# token, head), COMPANION_ROWS_PER_CTA of them per CTA, grid companion_grid, no dynamic shared
# memory: <name>_combine merges the partial results when num_splits > 1 (FagenFwdParams; rows:
# batch x seqlen_q x heads_q); <name>_append writes a call's new keys and values into the cache
# before the attention (FagenFwdParams k_new ... seqlen_new; rows: batch x seqlen_new x
# heads_kv); <name>_merge merges two attention results over disjoint key sets (FagenMergeParams,
# any head dim that is a multiple of 8; rows: batch x seqlen x heads).
SPLIT_COMBINE_SUFFIX = "_combine"
SPLIT_APPEND_SUFFIX = "_append"
SPLIT_MERGE_SUFFIX = "_merge"
COMPANION_ROWS_PER_CTA = 4
COMPANION_THREADS = 128
# The most splits of one (batch row, KV head, query block): the combine reads a partial row per
# split, and 64 splits of 256 keys already cover 16k keys with 2 KV heads on 132 SMs in one wave.
MAX_SPLITS = 64
# split_count takes the fewest splits whose last wave is at least this full (relative to the
# best count's): more splits than that cost partial writes and combine reads for no fuller wave.
SPLIT_WAVE_FILL = 0.85


def split_count(ctas: int, keys: int, slots: int, min_split_keys: int) -> int:
    """The splits of a split-KV launch: `ctas` units of work ((batch row, KV head, query
    block)s) of at most `keys` keys each (a cache's capacity, not its lengths: the grid is sized
    before the lengths are read, so a captured CUDA graph replays with any), on a GPU of `slots`
    SMs. The fewest splits whose wave fill (waves / ceil(waves), a wave one CTA per SM) is
    within SPLIT_WAVE_FILL of the best count's, up to MAX_SPLITS and no split under
    `min_split_keys` keys (Launch.min_split_keys). Waves of one CTA per SM, although two fit:
    bench.decode --sweep on the H200 (2026-12-02, hd128, 32:8 heads) measured batch 1 x 64k keys
    at 3055 GB/s with 16 splits (a CTA per SM) against 2845 with 29 (two per SM), and batch
    2 / 4 / 8 / 16 best at 8 / 4-8 / 2 / 1 splits, the counts this rule gives (within 1-4 %
    elsewhere). Mirrored by fagen.hpp's split_count."""
    if ctas <= 0 or keys <= 0 or slots <= 0:
        return 1
    limit = max(1, min(MAX_SPLITS, keys // max(min_split_keys, 1)))

    def fill(splits: int) -> float:
        waves = ctas * splits / slots
        return waves / math.ceil(waves)

    best = max(fill(n) for n in range(1, limit + 1))
    return next(n for n in range(1, limit + 1) if fill(n) >= SPLIT_WAVE_FILL * best)


@dataclass(frozen=True)
class SplitWorkspace:
    """The fp32 partial results of a split-KV launch with num_splits > 1, as float offsets into
    one buffer (FagenFwdParams o_partial, lse_partial): o_partial (num_splits, batch * seqlen_q,
    heads_q, head_dim_v), lse_partial (num_splits, heads_q, batch * seqlen_q); none for 1."""

    o_partial: int
    lse_partial: int
    floats: int

    @classmethod
    def of(cls, num_splits: int, batch: int, seqlen_q: int, heads_q: int, head_dim_v: int) -> "SplitWorkspace":
        if num_splits <= 1:
            return cls(0, 0, 0)
        rows = num_splits * batch * seqlen_q * heads_q
        return cls(o_partial=0, lse_partial=rows * head_dim_v, floats=rows * (head_dim_v + 1))


# A KV-cache call whose rows bring at least PAGED_TILE_MIN_QUERIES query tokens (a prefill) runs
# on a tile kernel of the paged layout (FA4 on sm100a, FA3 on sm90a: K/V read once per 128
# queries of a head, not once per 16 GQA-packed rows) when the bundle has one; its K/V tiles load
# in runs of keys, each from its own page (cache_box_rows), CACHE_TMA_BOX_ROWS at least (the
# page-size multiple).
PAGED_TILE_MIN_QUERIES = 128
# A page size is a multiple of this: the split-KV kernels look pages up in runs of 16 keys, the
# tile kernels load boxes of 16 keys at least (vLLM's pages are 16 keys).
PAGE_SIZE_MULTIPLE = 16
CACHE_TMA_BOX_ROWS = PAGE_SIZE_MULTIPLE


def cache_box_rows(page_size: int, tile_rows: int) -> int:
    """Keys per TMA box of a paged tile kernel's K/V tile of `tile_rows` keys (its launch's
    tma_kv_rows) over pages of `page_size` keys (0: a contiguous cache): the whole tile where a
    page (or a cache row) holds whole tiles, a page where a tile holds whole pages, else runs of
    CACHE_TMA_BOX_ROWS. Mirrored by templates/include/fagen/algo/tma_tile.cuh: cache_box_rows."""
    if page_size == 0 or page_size % tile_rows == 0:
        return tile_rows
    return page_size if tile_rows % page_size == 0 else CACHE_TMA_BOX_ROWS


def companion_grid(batch: int, rows: int, heads: int) -> tuple[int, int, int]:
    return (-(-batch * rows * heads // COMPANION_ROWS_PER_CTA), 1, 1)
