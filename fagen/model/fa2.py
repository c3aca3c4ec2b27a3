"""FA2 forward (mma.sync, sm80+): its tile, geometry, template constexprs and launch.

The geometry is computed once here: validation rejects tiles that cannot fit, codegen passes
the same numbers to the template, which re-checks them with static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import MAX_REGISTERS_PER_THREAD, Arch
from .base import Constexpr, KernelSpec, SoftmaxTricksTile
from .layout import ELEMENT_BYTES, TileGeometry, smem_limit_problems, value_dim_rule
from .tuning import TuningRow

MMA_M = 16  # mma.sync.m16n8k16: a warp's rows come in groups of 16
MMA_N = 8
MMA_K = 16
VECTOR_BYTES = 16  # cp.async / ldmatrix / epilogue stores move 16-byte vectors
WARP_ROW_CHOICES = (16, 32)  # rows per warp: 1 or 2 m16 tiles
WARP_CHOICES = (1, 2, 4, 8)
# K/V ring depth; 2 = load block j+1 while computing block j. 1 = one K and one V buffer, each
# reloaded while the other is in use (V_j during Q K_j^T, K_{j+1} during softmax and P V_j): half
# the shared memory of 2 stages, so two CTAs fit on an SM where one would otherwise.
STAGE_RANGE = (1, 4)
# Registers beyond the two accumulators: Q/K/V fragments, row max/sum, addresses, loop state.
# Measured on the shipped variants (ptxas -v): 40-60; 48 keeps the estimate honest without
# rejecting tiles that compile without spills.
REGISTER_OVERHEAD = 48


class Fa2Tile(SoftmaxTricksTile):
    ALGORITHM: ClassVar[str] = "fa2 fwd"

    block_m: int = Field(gt=0, description="query rows per CTA")
    block_n: int = Field(gt=0, description="key rows per K/V tile")
    warps: int = Field(gt=0, description="warps per CTA")
    stages: int = Field(gt=0, description="K/V shared-memory ring depth (1: one K and one V "
                        "buffer taking turns)")


@dataclass(frozen=True)
class Fa2Geometry(TileGeometry):
    @property
    def warp_rows(self) -> int:
        return self.block_m // self.warps

    @property
    def row_pitch_bytes(self) -> int:
        """Q and K rows. One 16-byte vector of padding per row: the 8 rows an ldmatrix reads
        then start in 8 distinct bank groups (head_dim/8 + 1 vectors per row is odd for every
        head_dim that is a multiple of 16), so ldmatrix and cp.async are conflict-free without
        a swizzle."""
        return row_pitch_bytes(self.head_dim)

    @property
    def v_row_pitch_bytes(self) -> int:
        """V rows, padded the same way."""
        return row_pitch_bytes(self.head_dim_v)

    @property
    def smem_q_bytes(self) -> int:
        return self.block_m * self.row_pitch_bytes

    @property
    def smem_kv_stage_bytes(self) -> int:
        return self.block_n * (self.row_pitch_bytes + self.v_row_pitch_bytes)

    @property
    def smem_bytes(self) -> int:
        # The epilogue stages O through the Q buffer (head_dim_v <= head_dim), so it needs no
        # space of its own.
        return self.smem_q_bytes + self.stages * self.smem_kv_stage_bytes

    @property
    def accumulator_registers(self) -> int:
        """fp32 registers per thread for the O and S accumulators."""
        return self.warp_rows * (self.head_dim_v + self.block_n) // 32

    @property
    def estimated_registers(self) -> int:
        return self.accumulator_registers + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        """Why this tile cannot work, one message per violated limit (empty when it fits)."""
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.warps not in WARP_CHOICES:
            out.append(f"tile.warps={self.warps}: must be one of {WARP_CHOICES}")
        elif self.block_m % self.warps or self.warp_rows not in WARP_ROW_CHOICES:
            out.append(
                f"tile.block_m={self.block_m} with tile.warps={self.warps} gives "
                f"{self.block_m / self.warps:g} rows per warp; must be one of {WARP_ROW_CHOICES}"
            )
        if self.block_n % MMA_K or not (MMA_K <= self.block_n <= 256):
            out.append(f"tile.block_n={self.block_n}: must be a multiple of {MMA_K} in [16, 256]")
        if not (STAGE_RANGE[0] <= self.stages <= STAGE_RANGE[1]):
            out.append(f"tile.stages={self.stages}: must be in [{STAGE_RANGE[0]}, {STAGE_RANGE[1]}]")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > MAX_REGISTERS_PER_THREAD:
            out.append(
                f"tile (block_m={self.block_m}, warps={self.warps}, block_n={self.block_n}) "
                f"needs about {self.estimated_registers} registers per thread at "
                f"{self.head_dims} ({self.accumulator_registers} for the accumulators); "
                f"the limit is {MAX_REGISTERS_PER_THREAD}: use fewer rows per warp or a smaller block_n"
            )
        return out


def row_pitch_bytes(head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
    """A shared-memory row of `head_dim` elements and one 16-byte vector of padding (an odd
    number of vectors: ldmatrix and cp.async conflict-free without a swizzle)."""
    return head_dim * element_bytes + VECTOR_BYTES


def mma_sync_head_dim_problem(head_dim: int, kernel: str) -> str | None:
    """Why no tile of an mma.sync kernel (FA1, the FA2 forward and backward; `kernel` names it in
    the message) can take `head_dim`, or None."""
    if head_dim % MMA_K or not 0 < head_dim <= contract.MAX_HEAD_DIM:
        return (f"head_dim={head_dim}: {kernel} needs a multiple of {MMA_K} up to "
                f"{contract.MAX_HEAD_DIM} (mma.sync k-step and ldmatrix pairs)")
    return None


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA2 forward tile can take `head_dim`, or None."""
    return mma_sync_head_dim_problem(head_dim, "the FA2 template")


# ---- FA2 forward (mma.sync). Register counts are ptxas's for sm90, bf16; speeds from the
# H200 tile sweep of 2026-11-30 (bench/tile_sweep.py, docs/performance.md), seqlen 4k. ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa2Tile(block_m=128, block_n=64, warps=4, stages=2), 64,
              "32 rows per warp: each K/V fragment read from smem feeds 2 MMAs; 1.06x/1.02x "
              "SDPA-FA2 (full/causal), within 1% of block_n 128, which spills on sm80; 55 KB smem"),
    TuningRow(Fa2Tile(block_m=64, block_n=64, warps=4, stages=2), 64,
              "fallback for 99 KB parts: 16 rows per warp, 55 KB smem"),
    TuningRow(Fa2Tile(block_m=64, block_n=64, warps=4, stages=2), 128,
              "any score modifier: the 128 x 32 tile below (247 registers) spilled 16-24 bytes "
              "with a modifier's registers on sm90 (sinks, ALiBi; 2026-12-02)",
              score=("softcap", "alibi", "sinks")),
    TuningRow(Fa2Tile(block_m=64, block_n=64, warps=4, stages=2), 128,
              "a custom mask: the 128 x 32 tile below spilled 36 bytes with the document mask's "
              "element mask on every block (2026-12-02)", mask="custom"),
    TuningRow(Fa2Tile(block_m=128, block_n=32, warps=4, stages=2), 128,
              "32 rows per warp with block_n 32 keeps O (128) + S (32) under 255 regs (244-253, "
              "no spills on sm80/86/90): 0.94x/0.97x SDPA-FA2 against 0.82x/0.81x for 16 rows "
              "per warp (m128n64w8); head_dim 96 takes it by the same register arithmetic"),
    TuningRow(Fa2Tile(block_m=64, block_n=64, warps=4, stages=2), 128,
              "fallback for 99 KB parts: 16 rows per warp, 52 KB smem"),
    TuningRow(Fa2Tile(block_m=128, block_n=64, warps=8, stages=1), 256,
              "O alone is 128 regs at 16 rows per warp, so 16 rows and 8 warps. One K and one V "
              "buffer (stages 1) instead of a 2-stage ring: 0.93/0.93x SDPA-FA2 (full/causal) at "
              "2k against 0.90/0.90x (H200 run 13, 2026-11-30); 64x64 with 4 warps (2 CTAs per "
              "SM, SDPA-FA2's own tile) measured 0.90/0.94x; 132 KB smem at head_dim 256, so "
              "sm80 (163 KB) takes this row too (not measured on an A100)"),
    TuningRow(Fa2Tile(block_m=64, block_n=32, warps=4, stages=2), 256,
              "fallback for sm80's 163 KB and 99 KB parts: 64x32 tile, 16 rows per warp"),
)


class Fa2ForwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(
        value_dim_rule(head_dim_problem, "the epilogue stages O through Q's buffer"))
    MASKS: ClassVar[tuple[str, ...]] = contract.MASK_KINDS
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen")
    FA_VERSION: ClassVar[int] = 2
    DIRECTION: ClassVar[str] = "fwd"
    TEMPLATE: ClassVar[str] = "fa2_fwd_sm80.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = (Arch.sm80, Arch.sm86, Arch.sm89, Arch.sm90, Arch.sm100a,
                                         Arch.sm120)
    WHY_ARCHS: ClassVar[str] = ("mma.sync m16n8k16, ldmatrix and cp.async exist from sm80 on; "
                                "sm90a adds nothing it uses, so Hopper takes the plain sm90 build")
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HMMA", "LDSM", "LDGSTS")

    fa_version: Literal[2]
    direction: Literal["fwd"] = "fwd"
    tile: Fa2Tile

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa2Tile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa2Geometry:
        return Fa2Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                           head_dim_v=head_dim_v,
                           element_bytes=contract.DTYPE_BYTES[dtype])

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kWarps", g.warps),
            Constexpr("kThreads", g.threads),
            Constexpr("kWarpRows", g.warp_rows),
            Constexpr("kStages", g.stages),
            Constexpr("kRowPitchBytes", g.row_pitch_bytes),
            Constexpr("kVRowPitchBytes", g.v_row_pitch_bytes),
            Constexpr("kSmemQBytes", g.smem_q_bytes),
            Constexpr("kSmemKVStageBytes", g.smem_kv_stage_bytes),
            Constexpr("kSmemBytes", g.smem_bytes),
            *self.tile.softmax_constexprs(),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, dynamic_smem=g.smem_bytes)
