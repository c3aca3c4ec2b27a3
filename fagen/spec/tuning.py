"""The one tuning table: what `tile: auto` resolves to.

Each row: the head dims it covers, the tile, and why. Within a head-dim bucket the rows are
tried in order and the first that fits the target's shared memory and registers wins, so a
smaller-smem target (sm86/sm89/sm120: 99 KB) falls through to a smaller tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ARCHS, Arch
from .fa2 import Fa2Geometry


@dataclass(frozen=True)
class TuningRow:
    fa_version: int
    max_head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    reason: str


TABLE: tuple[TuningRow, ...] = (
    # ---- FA2 forward (mma.sync). Register counts are ptxas's for sm90, bf16 (2026-11-30). ----
    TuningRow(2, 64, 128, 64, 4, 2,
              "32 rows per warp: each K/V fragment read from smem feeds 2 MMAs; block_n 128 "
              "spills on sm80 (255 regs), block_n 64 compiles to 225; 55 KB smem -> 4 CTAs/SM"),
    TuningRow(2, 64, 64, 64, 4, 2,
              "fallback for 99 KB parts: 16 rows per warp, 55 KB smem"),
    TuningRow(2, 128, 128, 64, 8, 2,
              "16 rows per warp: at 32 rows O (128) + S (64) spill past 255 regs; 182 regs, "
              "104 KB smem -> 2 CTAs (16 warps) per SM on sm90"),
    TuningRow(2, 128, 64, 64, 4, 2,
              "fallback for 99 KB parts: 16 rows per warp, 52 KB smem"),
    TuningRow(2, 256, 128, 64, 8, 2,
              "O alone is 128 regs at 16 rows per warp, so 16 rows and 8 warps; "
              "203 KB smem at head_dim 256 -> 1 CTA (8 warps) per SM on sm90"),
    TuningRow(2, 256, 64, 32, 4, 2,
              "fallback for sm80's 163 KB and 99 KB parts: 64x32 tile, 16 rows per warp"),
)


def resolve_tile(fa_version: int, arch: Arch, head_dim: int) -> TuningRow:
    """The first row of this algorithm's head-dim bucket that fits `arch`.

    Raises ValueError naming every row tried and why it was rejected.
    """
    rows = [r for r in TABLE if r.fa_version == fa_version and head_dim <= r.max_head_dim]
    if not rows:
        raise ValueError(
            f"tile: auto has no entry for fa_version={fa_version} at head_dim={head_dim}; "
            "give the tile explicitly"
        )
    bucket = min(r.max_head_dim for r in rows)
    max_smem = ARCHS[arch].max_smem_per_block
    tried: list[str] = []
    for row in (r for r in rows if r.max_head_dim == bucket):
        geometry = Fa2Geometry(head_dim, row.block_m, row.block_n, row.warps, row.stages)
        problems = geometry.problems(max_smem)
        if not problems:
            return row
        tried.append(f"m{row.block_m}n{row.block_n}w{row.warps}s{row.stages}: {'; '.join(problems)}")
    raise ValueError(
        f"tile: auto found no fitting tile for fa_version={fa_version}, arch={arch.value}, "
        f"head_dim={head_dim}: " + " | ".join(tried)
    )
