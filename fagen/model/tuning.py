"""What `tile: auto` resolves to: each algorithm keeps its tuning rows beside its model
(`TUNING` in fa1.py ... fa4.py, its spec's TUNING_ROWS); this module resolves them.

Each row: the algorithm's tile (an instance of its tile model), the head dims it covers, and
why. Within a head-dim bucket of an algorithm the rows are tried in order and the first that
fits the target's shared memory and registers wins, so a smaller-smem target (sm86/sm89/sm120:
99 KB) falls through to a smaller tile.

A row may carry `max_seqlen_k`: the tile that measured best for calls with at most that many
keys. `tile: auto` then yields one kernel per bound of the bucket (plus the unbounded one), and
the runtime picks among a key's kernels by the call's seqlen_k (fagen.runtime.loader.select):
the smallest bound that covers it, else the unbounded kernel. Bounds choose between correct
kernels; they never make a call fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arch import ARCHS, Arch

if TYPE_CHECKING:
    from .base import KernelSpec, TileBase


@dataclass(frozen=True)
class TuningRow:
    tile: TileBase
    max_head_dim: int
    reason: str
    # True: the row serves the masks with a diagonal (causal, local), False: the full mask;
    # None: every mask. A window takes the causal rows (like FA3's tile_size.h, whose local and
    # causal tiles are one), not their short-sequence bounds: windows are for long rows.
    causal: bool | None = None
    max_seqlen_k: int | None = None  # None: any seqlen_k not covered by a bounded row
    # The score modifiers (contract.SCORE_MODS) the row is for: it serves only the kernels with
    # one of them, before the rows for every kernel (None), where those modifiers' registers
    # made the general tile spill.
    score: tuple[str, ...] | None = None
    # The v head dim the row is for, where it differs from the q/k one (DeepSeek-V3's 192/128):
    # it serves only those kernels, before the general rows. None: any head_dim_v.
    head_dim_v: int | None = None
    # The mask kind the row is for (custom: a user's mask, whose element mask runs on every
    # visited block): it serves only those kernels, before the general rows. None: any.
    mask: str | None = None
    # The layout the row is for (contract.LAYOUTS), where that layout's code made the general
    # tile spill: it serves only those kernels, before the general rows. None: any.
    layout: str | None = None
    # The element types (contract.DTYPES) the row serves: an e4m3 kernel's tile differs from the
    # 16-bit ones' (1-byte rows, a V^T tile), so each row names the types it was measured for.
    dtypes: tuple[str, ...] = ("fp16", "bf16")


def _bucket_rows(algorithm: type[KernelSpec], head_dim: int, mask: str,
                 score: tuple[str, ...] = (), head_dim_v: int | None = None,
                 layout: str = "dense", dtype: str = "bf16") -> list[TuningRow]:
    rows = [r for r in algorithm.TUNING_ROWS if head_dim <= r.max_head_dim
            and r.causal in (None, mask != "full")
            and not (mask in ("local", "custom") and r.max_seqlen_k is not None)
            and (r.score is None or set(r.score) & set(score))
            and r.head_dim_v in (None, head_dim_v)
            and r.mask in (None, mask)
            and r.layout in (None, layout)
            and dtype in r.dtypes]
    if not rows:
        raise ValueError(
            f"tile: auto has no entry for fa_version={algorithm.FA_VERSION} dtype={dtype} "
            f"{algorithm.DIRECTION} at head_dim={head_dim}; give the tile explicitly"
        )
    bucket = min(r.max_head_dim for r in rows)
    rows = [r for r in rows if r.max_head_dim == bucket]
    special = [r for r in rows if r.score is not None or r.head_dim_v is not None or r.mask is not None
               or r.layout is not None]
    return special + [r for r in rows if r not in special]


def _serving_bound(bounds: set[int | None], max_seqlen_k: int | None) -> int | None:
    """The bound whose rows serve calls of up to `max_seqlen_k` keys: the smallest bound that
    covers it, else None (the unbounded rows). The runtime applies the same rule to kernels."""
    if max_seqlen_k is None:
        return None
    covering = [b for b in bounds if b is not None and b >= max_seqlen_k]
    return min(covering) if covering else None


def resolve_tile(algorithm: type[KernelSpec], arch: Arch, head_dim: int, mask: str = "full",
                 max_seqlen_k: int | None = None, score: tuple[str, ...] = (),
                 head_dim_v: int | None = None, layout: str = "dense", dtype: str = "bf16") -> TileBase:
    """The tile of the first row of `algorithm`'s head-dim bucket that fits `arch`, the mask,
    the score modifiers, the v head dim (None: head_dim) and the layout, among the rows that serve calls of
    up to `max_seqlen_k` keys (None: the unbounded rows).

    Raises ValueError naming every row tried and why it was rejected.
    """
    rows = _bucket_rows(algorithm, head_dim, mask, score, head_dim_v, layout, dtype)
    bound = _serving_bound({r.max_seqlen_k for r in rows}, max_seqlen_k)
    tried: list[str] = []
    for row in (r for r in rows if r.max_seqlen_k == bound):
        geometry = algorithm.geometry_of(head_dim, row.tile, head_dim_v, dtype)
        problems = geometry.problems(ARCHS[arch].max_smem_per_block)
        if not problems:
            return row.tile
        tried.append(f"{row.tile.sizes}: {'; '.join(problems)}")
    raise ValueError(
        f"tile: auto found no fitting tile for fa_version={algorithm.FA_VERSION}, "
        f"arch={arch.value}, {geometry.head_dims}: " + " | ".join(tried)
    )


def seqlen_bounds(algorithm: type[KernelSpec], arch: Arch, head_dim: int,
                  mask: str = "full", dtype: str = "bf16") -> list[int]:
    """The seqlen_k bounds `tile: auto` builds extra kernels for on this target, ascending:
    those with a fitting row whose tile differs from the unbounded choice."""
    rows = _bucket_rows(algorithm, head_dim, mask, dtype=dtype)
    general = resolve_tile(algorithm, arch, head_dim, mask, dtype=dtype)
    bounds = []
    for bound in sorted({r.max_seqlen_k for r in rows} - {None}):
        try:
            tile = resolve_tile(algorithm, arch, head_dim, mask, bound, dtype=dtype)
        except ValueError:
            continue  # no row of this bound fits the target
        if tile != general:
            bounds.append(bound)
    return bounds
