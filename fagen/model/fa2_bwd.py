"""FA2 backward (mma.sync, sm80+): its tile, geometry, template constexprs and launch.

One CTA per (key block, K/V head, batch) walks every query block of the query heads its K/V head
serves (templates/include/fagen/fa2/backward.cuh). The geometry is computed once here:
validation rejects tiles that cannot fit, codegen passes the same numbers to the template, which
re-checks them with static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import ARCHS, MAX_REGISTERS_PER_THREAD, Arch
from .base import Constexpr, KernelSpec, TileBase
from .companions import backward_row_constexprs
from .fa2 import Fa2ForwardSpec, mma_sync_head_dim_problem, row_pitch_bytes
from .layout import TileGeometry, smem_limit_problems, value_dim_rule
from .tuning import TuningRow

MMA_M = 16  # rows of an mma.sync m16n8k16 tile: the unit of a warp's keys and dQ rows
WARP_CHOICES = (4, 8)
STAGE_CHOICES = (1, 2)  # Q_i, dO_i buffers: 2 = the next query block loads during this one
# Registers beyond dK / dV and S^T / dP^T (the largest live set): addresses, loop state, the
# fragments of one k-step. As the forward's (fa2.py).
REGISTER_OVERHEAD = 48


class Fa2BwdTile(TileBase):
    ALGORITHM: ClassVar[str] = "fa2 bwd"

    block_m: int = Field(gt=0, description="query rows per step of the walk over query blocks")
    block_n: int = Field(gt=0, description="keys per CTA (dK, dV rows in registers)")
    warps: int = Field(gt=0, description="warps per CTA")
    stages: int = Field(gt=0, description="Q / dO buffers: 2 loads the next query block ahead")
    warp_keys: int = Field(
        MMA_M, gt=0, description="keys per warp in S^T, dP^T, dK and dV (a multiple of 16): "
        "more rows per warp read each shared-memory operand for more MMAs")
    warp_queries: int = Field(
        MMA_M, gt=0, description="query rows per warp in dQ (a multiple of 16)")

    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("warp_keys", "wk"), ("warp_queries", "wq"))


@dataclass(frozen=True)
class Fa2BwdGeometry(TileGeometry):
    warp_keys: int = MMA_M
    warp_queries: int = MMA_M

    @property
    def key_groups(self) -> int:
        return self.block_n // self.warp_keys

    @property
    def col_splits(self) -> int:
        """Parts of the queries (S^T) and of head_dim (dK; dV: of head_dim_v) the warps of a
        key group take."""
        return self.warps // self.key_groups

    @property
    def s_cols(self) -> int:
        return self.block_m // self.col_splits

    @property
    def k_cols(self) -> int:
        """dK columns per warp."""
        return self.head_dim // self.col_splits

    @property
    def v_cols(self) -> int:
        """dV columns per warp."""
        return self.head_dim_v // self.col_splits

    @property
    def probs_in_registers(self) -> bool:
        """A warp that holds all of a step's queries for its keys (one column part) multiplies
        its P^T and dS^T into dV and dK straight from the S^T / dP^T accumulators; with more
        parts the products need the other warps' columns, so P^T goes through shared memory.
        dS^T always does: dQ = dS K reads it across the key groups."""
        return self.col_splits == 1

    @property
    def query_groups(self) -> int:
        return self.block_m // self.warp_queries

    @property
    def dq_splits(self) -> int:
        return self.warps // self.query_groups

    @property
    def dq_cols(self) -> int:
        return self.head_dim // self.dq_splits

    @property
    def row_pitch_bytes(self) -> int:
        """Q and K rows: as the forward's (an odd number of 16-byte vectors)."""
        return row_pitch_bytes(self.head_dim)

    @property
    def v_row_pitch_bytes(self) -> int:
        """V and dO rows (head_dim_v elements), padded the same way."""
        return row_pitch_bytes(self.head_dim_v)

    @property
    def p_row_pitch_bytes(self) -> int:
        """P^T and dS^T rows (block_m elements), padded the same way."""
        return row_pitch_bytes(self.block_m)

    @property
    def smem_bytes(self) -> int:
        pitches = self.row_pitch_bytes + self.v_row_pitch_bytes
        kv = self.block_n * pitches
        stage = self.block_m * pitches + 2 * self.block_m * 4  # Q, dO, LSE, D
        p_tiles = 1 if self.probs_in_registers else 2  # dS^T, and P^T unless in registers
        return kv + self.stages * stage + p_tiles * self.block_n * self.p_row_pitch_bytes

    @property
    def estimated_registers(self) -> int:
        """dK, dV (warp_keys x k_cols, v_cols) and S^T, dP^T (warp_keys x s_cols each), per
        thread."""
        return self.warp_keys * (self.k_cols + self.v_cols + 2 * self.s_cols) // 32 + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.warps not in WARP_CHOICES:
            out.append(f"tile.warps={self.warps}: must be one of {WARP_CHOICES}")
        if self.warp_keys % MMA_M or self.warp_queries % MMA_M:
            out.append(f"tile (warp_keys={self.warp_keys}, warp_queries={self.warp_queries}): "
                       f"both must be multiples of {MMA_M}")
        elif self.block_n % self.warp_keys or self.block_m % self.warp_queries:
            out.append(f"tile (block_m={self.block_m}, block_n={self.block_n}): must be multiples "
                       f"of warp_queries={self.warp_queries} and warp_keys={self.warp_keys}")
        if self.stages not in STAGE_CHOICES:
            out.append(f"tile.stages={self.stages}: must be one of {STAGE_CHOICES}")
        if out:
            return out
        if self.key_groups > self.warps or self.warps % self.key_groups:
            out.append(f"tile.block_n={self.block_n}: {self.key_groups} groups of {self.warp_keys} keys "
                       f"must divide tile.warps={self.warps}")
        elif self.query_groups > self.warps or self.warps % self.query_groups:
            out.append(f"tile.block_m={self.block_m}: {self.query_groups} groups of "
                       f"{self.warp_queries} queries must divide tile.warps={self.warps}")
        else:
            for name, cols in (("S^T columns", self.s_cols), ("dK columns", self.k_cols),
                               ("dV columns", self.v_cols), ("dQ columns", self.dq_cols)):
                if cols % 16 or cols <= 0:
                    out.append(f"tile (block_m={self.block_m}, block_n={self.block_n}, warps="
                               f"{self.warps}) gives {cols} {name} per warp at "
                               f"{self.head_dims}; must be a multiple of 16 (ldmatrix pairs)")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > MAX_REGISTERS_PER_THREAD:
            out.append(f"tile (block_m={self.block_m}, block_n={self.block_n}, warps={self.warps}) "
                       f"needs about {self.estimated_registers} registers per thread at "
                       f"{self.head_dims}; the limit is {MAX_REGISTERS_PER_THREAD}")
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA2 backward tile can take `head_dim`, or None."""
    return mma_sync_head_dim_problem(head_dim, "the FA2 backward")


# ---- FA2 backward (mma.sync): one CTA per key block keeps dK, dV in registers and walks
# the query blocks. Shared memory's bandwidth runs out first (Nsight Compute, run 99: L1 75 %
# busy, the warps' main stall the ldmatrix results), so the warps hold 32 keys (S^T, dK,
# dV) and 32 query rows (dQ) where the registers allow: each operand fragment read from
# shared memory feeds two MMAs' worth of rows, 20 % fewer bytes per step than one-tile
# warps, at the price of P^T through shared memory. Register and shared-memory counts are
# the geometry's (fagen/model/fa2_bwd.py) and ptxas's (sm90, bf16); speeds from the H200
# sweep of run 100 (bench.tile_sweep, bf16, 4k / 8k; 2026-12-01) against SDPA-FA2's backward
# in the same run. sm80 rows are the sm90 tiles with one Q / dO stage (163 KB), measured
# on the H200 (run 101), not on an A100. ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 64,
              "softcap or ALiBi: the 128 x 128 tile below spilled 8-156 bytes with the "
              "modifier's registers (2026-12-02), so head_dim 128's tile", score=("softcap", "alibi")),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 64,
              "softcap or ALiBi on sm80's 163 KB: one Q / dO stage", score=("softcap", "alibi")),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 64,
              "a custom mask: the 128 x 128 tile below spilled 12 bytes with the document mask's "
              "element mask on every step (2026-12-02); 228 regs", mask="custom"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 64,
              "a custom mask on sm80's 163 KB: one Q / dO stage", mask="custom"),
    TuningRow(Fa2BwdTile(block_m=128, block_n=128, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 64,
              "128 x 128, warps of 32 keys x 64 queries (S^T) and 32 x 32 (dK, dV, dQ): 247 / 223 "
              "TFLOP/s full / causal at 4k (0.88 / 0.90x SDPA-FA2) against 219 / 210 for 64 x 128 "
              "with one-tile warps and K, V in registers; 253-255 regs, 178 KB smem"),
    TuningRow(Fa2BwdTile(block_m=128, block_n=128, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 64,
              "sm80's 163 KB: one Q / dO stage, 141 KB; on the H200 234 / 216 TFLOP/s full / "
              "causal at 4k (0.84 / 0.88x SDPA-FA2)"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=64, warps=4, stages=1), 64,
              "fallback for 99 KB parts: 55 KB"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 128,
              "ALiBi: with two Q / dO stages the distance's registers spilled 8 bytes at head_dim "
              "128 (2026-12-02); one stage, as on sm80", score=("alibi",)),
    TuningRow(Fa2BwdTile(block_m=64, block_n=64, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 128,
              "a custom mask: every 64 x 128 tile spilled 4-20 bytes with the document mask's "
              "element mask on every step (2026-12-02); 64 keys: 194 regs, 124 KB smem",
              mask="custom"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 128,
              "64 x 128, warps of 32 keys x 32 queries (S^T), 32 keys x 64 columns (dK, dV), 32 x "
              "32 (dQ): 266 / 243 TFLOP/s full / causal at 4k (0.88 / 0.89x SDPA-FA2) against 239 "
              "/ 216 for one-tile warps (P^T in registers) and 243 / 219 with 32-row dQ warps "
              "alone; 246-255 regs, 173 KB smem"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 128,
              "sm80's 163 KB: one Q / dO stage, 139 KB; on the H200 245 / 226 TFLOP/s full / "
              "causal at 4k (0.81 / 0.83x SDPA-FA2)"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=128, warps=8, stages=2), 128,
              "head_dim 96 (32-row dQ warps would hold 24 columns): one-tile warps, P^T in "
              "registers; 155 KB smem"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=64, warps=8, stages=1), 128,
              "fallback for 99 KB parts: one Q / dO buffer, 87 KB"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=64, warps=8, stages=2, warp_keys=32,
                         warp_queries=32), 256,
              "warps of 32 keys x 16 queries (S^T), 32 keys x 64 columns (dK, dV), 32 x 64 (dQ): "
              "199 / 187 TFLOP/s full / causal at 4k (0.79 / 0.81x SDPA-FA2) against 190 / 176 "
              "for one-tile warps; 253-255 regs, 217 KB smem (sm90)"),
    TuningRow(Fa2BwdTile(block_m=64, block_n=64, warps=8, stages=1, warp_keys=32,
                         warp_queries=32), 256,
              "sm80's 163 KB: one Q / dO stage, 150 KB; on the H200 186 / 176 TFLOP/s full / "
              "causal at 4k (0.73 / 0.77x SDPA-FA2)"),
    TuningRow(Fa2BwdTile(block_m=32, block_n=32, warps=4, stages=1), 256,
              "fallback for 99 KB parts: 71 KB"),
)


class Fa2BackwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(
        value_dim_rule(head_dim_problem, "as the forward it differentiates"))
    MASKS: ClassVar[tuple[str, ...]] = contract.MASK_KINDS
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen")
    FA_VERSION: ClassVar[int] = 2
    DIRECTION: ClassVar[str] = "bwd"
    TEMPLATE: ClassVar[str] = "fa2_bwd_sm80.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = Fa2ForwardSpec.ARCHS
    WHY_ARCHS: ClassVar[str] = Fa2ForwardSpec.WHY_ARCHS
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HMMA", "LDSM", "LDGSTS")

    fa_version: Literal[2]
    direction: Literal["bwd"]
    tile: Fa2BwdTile

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa2BwdTile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa2BwdGeometry:
        return Fa2BwdGeometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                              tile.warp_keys, tile.warp_queries, head_dim_v=head_dim_v,
                              element_bytes=contract.DTYPE_BYTES[dtype])

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kWarps", g.warps),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kWarpKeys", g.warp_keys),
            Constexpr("kWarpQueries", g.warp_queries),
            Constexpr("kRowPitchBytes", g.row_pitch_bytes),
            Constexpr("kVRowPitchBytes", g.v_row_pitch_bytes),
            Constexpr("kPRowPitchBytes", g.p_row_pitch_bytes),
            Constexpr("kProbsInRegisters", g.probs_in_registers),
            Constexpr("kSmemBytes", g.smem_bytes),
            # sm_90 adds four dQ columns in one vector reduction (ptx/red.cuh).
            Constexpr("kVectorReductions", ARCHS[self.arch].compute_capability >= (9, 0)),
            *backward_row_constexprs(),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, block_n=g.block_n,
                               dynamic_smem=g.smem_bytes, grid="key_blocks")
