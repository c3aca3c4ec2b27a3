"""The constexprs of the entry points a cubin carries beside its main kernel, which every
algorithm that has them takes from the contract alike: the backward's row kernels
(algo/backward_rows.cuh), e4m3's V^T companion (algo/v_transpose.cuh) and the paged layout's
append of new keys (algo/kv_cache.cuh) with its cache tiles' TMA runs (algo/tma_tile.cuh)."""

from __future__ import annotations

from .. import contract
from .base import Constexpr


def backward_row_constexprs() -> list[Constexpr]:
    """Rows and threads per CTA of the row kernels, the dQ accumulator's row padding."""
    return [
        Constexpr("kBwdRowsPerCta", contract.BWD_ROWS_PER_CTA),
        Constexpr("kBwdRowThreads", contract.BWD_ROW_THREADS),
        Constexpr("kDqAccumRowAlign", contract.DQ_ACCUM_ROW_ALIGN),
    ]


def paged_constexprs(layout: str) -> list[Constexpr]:
    """Whether the kernel reads a paged cache, the smallest run of keys its K/V tiles load, and
    the append's threads and rows per CTA."""
    return [
        Constexpr("kPaged", layout == "paged"),
        Constexpr("kCacheBoxRows", contract.CACHE_TMA_BOX_ROWS),
        Constexpr("kCompanionThreads", contract.COMPANION_THREADS),
        Constexpr("kCompanionRowsPerCta", contract.COMPANION_ROWS_PER_CTA),
    ]


def v_transpose_constexprs(head_dim_v: int) -> list[Constexpr]:
    """The V^T companion's keys per CTA, key group and threads."""
    return [
        Constexpr("kVtKeysPerCta", contract.VT_KEYS_PER_CTA),
        Constexpr("kVtKeyGroup", contract.VT_KEY_GROUP),
        Constexpr("kVtThreads", contract.vt_threads(head_dim_v)),
    ]
