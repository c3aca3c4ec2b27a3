"""FA1 forward (mma.sync, sm80+): the seeds' algorithm, for the lineage bundle.

FlashAttention-1's loop order (key/value blocks outer, query blocks inner), O rescaled and
normalised after every key block and kept with the row statistics in an fp32 workspace between
key blocks, one CTA per (head, batch): templates/include/fagen/fa1/forward.cuh says which parts
are FA1's and which are GPU practice. Not in the default bundle; specs/lineage.yaml builds it
beside FA2 and FA3 so that `fagen bench --lineage` can show what each generation bought.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import MAX_REGISTERS_PER_THREAD, Arch
from .base import Constexpr, KernelSpec, TileBase
from .fa2 import MMA_K, REGISTER_OVERHEAD, VECTOR_BYTES, mma_sync_head_dim_problem
from .layout import ELEMENT_BYTES, TileGeometry, smem_limit_problems
from .tuning import TuningRow

WARP_ROWS = 16  # one m16 tile per warp: the inner loop visits every query block of the head
WARP_CHOICES = (2, 4, 8)
# Per query row between key blocks: O (head_dim floats) and the running (max, sum).
STATE_FLOATS_PER_ROW = 2


class Fa1Tile(TileBase):
    ALGORITHM: ClassVar[str] = "fa1 fwd"

    block_m: int = Field(gt=0, description="query rows per inner-loop step (16 per warp)")
    block_n: int = Field(gt=0, description="keys per outer-loop step (one K and one V tile)")
    warps: int = Field(gt=0, description="warps per CTA")

    @property
    def sizes(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}"


@dataclass(frozen=True)
class Fa1Geometry(TileGeometry):
    """stages is 1: one K and one V buffer, loaded once per outer step; the inner loop over every
    query block of the head hides that load."""

    @property
    def row_pitch_bytes(self) -> int:
        # As FA2 (fa2.Fa2Geometry.row_pitch_bytes): an odd number of 16-byte vectors per row.
        return self.head_dim * ELEMENT_BYTES + VECTOR_BYTES

    @property
    def smem_q_bytes(self) -> int:
        """One Q buffer; there are two (the next query block loads while this one computes)."""
        return self.block_m * self.row_pitch_bytes

    @property
    def smem_bytes(self) -> int:
        return 2 * self.smem_q_bytes + 2 * self.block_n * self.row_pitch_bytes

    @property
    def workspace_floats_per_row(self) -> int:
        return self.head_dim + STATE_FLOATS_PER_ROW

    @property
    def estimated_registers(self) -> int:
        return WARP_ROWS * (self.head_dim + self.block_n) // 32 + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.warps not in WARP_CHOICES:
            out.append(f"tile.warps={self.warps}: must be one of {WARP_CHOICES}")
        elif self.block_m != WARP_ROWS * self.warps:
            out.append(f"tile.block_m={self.block_m}: must be {WARP_ROWS} x warps = "
                       f"{WARP_ROWS * self.warps}")
        if self.block_n % MMA_K or not (MMA_K <= self.block_n <= 256):
            out.append(f"tile.block_n={self.block_n}: must be a multiple of {MMA_K} in [16, 256]")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > MAX_REGISTERS_PER_THREAD:
            out.append(f"tile (block_n={self.block_n}) needs about {self.estimated_registers} "
                       f"registers per thread at head_dim={self.head_dim}; the limit is "
                       f"{MAX_REGISTERS_PER_THREAD}")
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA1 tile can take `head_dim`, or None."""
    return mma_sync_head_dim_problem(head_dim, "the FA1 template")


# ---- FA1 forward (mma.sync; the lineage bundle only). FA1 is the baseline the lineage
# benchmark measures FA2 and FA3 against, so its tiles are plain, not tuned: 16 rows per warp
# (the inner loop visits every query block of a head), 4 warps, and the widest key block
# whose K and V tiles, with two Q buffers, fit 99 KB parts too where the arithmetic allows.
# Register and shared-memory counts are the geometry's (fagen/model/fa1.py). ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa1Tile(block_m=64, block_n=128, warps=4), 64,
              "64 x 128 tile: S 64 + O 32 regs per thread; Q 2 x 9 KB + K, V 2 x 18 KB = 54 KB"),
    TuningRow(Fa1Tile(block_m=64, block_n=128, warps=4), 128,
              "S 64 + O 64 regs; Q 2 x 17 KB + K, V 2 x 34 KB = 102 KB (sm80, sm90)"),
    TuningRow(Fa1Tile(block_m=64, block_n=64, warps=4), 128,
              "fallback for 99 KB parts: K, V 2 x 17 KB, 68 KB in all"),
    TuningRow(Fa1Tile(block_m=64, block_n=64, warps=4), 256,
              "O alone is 128 regs per thread at head_dim 256, so block_n 64 (S 32); Q 2 x 33 KB "
              "+ K, V 2 x 33 KB = 132 KB (sm80, sm90)"),
    TuningRow(Fa1Tile(block_m=64, block_n=32, warps=4), 256,
              "fallback for 99 KB parts: 99 KB"),
)


class Fa1ForwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    FA_VERSION: ClassVar[int] = 1
    DIRECTION: ClassVar[str] = "fwd"
    TEMPLATE: ClassVar[str] = "fa1_fwd_sm80.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = (Arch.sm80, Arch.sm86, Arch.sm89, Arch.sm90, Arch.sm100a,
                                         Arch.sm120)
    WHY_ARCHS: ClassVar[str] = ("mma.sync m16n8k16, ldmatrix and cp.async exist from sm80 on; "
                                "Hopper takes the plain sm90 build")
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HMMA", "LDSM", "LDGSTS")
    MASKS: ClassVar[tuple[str, ...]] = ("full", "causal")
    WHY_MASKS: ClassVar[str] = ("FA1 is the lineage benchmark's baseline, which measures the full "
                                "and causal masks; windows are FA2's and FA3's")
    SCORE_MODS: ClassVar[tuple[str, ...]] = ()
    WHY_SCORE_MODS: ClassVar[str] = ("FA1 is the lineage benchmark's baseline, which has no score "
                                     "modifiers; they are FA2's and FA3's")

    fa_version: Literal[1]
    direction: Literal["fwd"] = "fwd"
    tile: Fa1Tile

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa1Tile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa1Geometry:
        return Fa1Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, 1, head_dim_v=head_dim_v,
                           element_bytes=contract.DTYPE_BYTES[dtype])

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kWarps", g.warps),
            Constexpr("kThreads", g.threads),
            Constexpr("kWarpRows", WARP_ROWS),
            Constexpr("kRowPitchBytes", g.row_pitch_bytes),
            Constexpr("kSmemQBytes", g.smem_q_bytes),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kWorkspaceFloatsPerRow", g.workspace_floats_per_row),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, dynamic_smem=g.smem_bytes,
                               grid="heads", workspace_floats_per_row=g.workspace_floats_per_row)
