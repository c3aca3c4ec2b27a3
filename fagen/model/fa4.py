"""FA4 forward (tcgen05 + TMEM + TMA, sm100a): its tile, geometry, template constexprs and
launch.

The geometry is computed once here: validation rejects tiles that cannot fit shared memory or
Tensor Memory, codegen passes the same numbers to the template, which re-checks them with
static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .. import contract
from .arch import Arch
from .base import Constexpr, KernelSpec, SoftmaxTricksTile
from .companions import paged_constexprs, v_transpose_constexprs
from .layout import MBARRIERS_PER_STAGE, TMA_COLUMNS, TmaRingLayout, smem_limit_problems, value_dim_rule
from .tuning import TuningRow

BLOCK_M = 128  # one M = 128 tcgen05.mma: TMEM lane = query row = softmax thread
# Role warps (templates/include/fagen/fa4/forward.cuh): 4 softmax, 4 correction, then load, MMA
# and 2 idle warps completing the third warpgroup (setmaxnreg acts on whole warpgroups).
WARPS = 12
TMEM_COLUMNS = 512  # TMEM per SM: 128 lanes x 512 columns of 32 bits
STAGE_RANGE = (2, 6)
# q_full, s_full x2, p_full x2, scale_full x2, o_ready, pv_done, stats_full; the paged layout's
# v_cleared after them.
FIXED_MBARRIERS = 10
# After the mbarriers: the TMEM address (16 bytes keep the floats aligned), then per query row
# two rescale factors in flight and the final row sum.
TMEM_SLOT_BYTES = 16
ROW_FLOATS = 3
# Registers after setmaxnreg, per thread of each warpgroup. Softmax holds a whole S row
# (block_n fp32) plus 16 packed P values and its state: at 168 (the even split of 64K over 384
# threads) block_n 128 spilled 12 bytes. Correction needs 16 O values and 8 packed outputs at a
# time; the load and MMA lanes need addresses and loop state only.
# 128 x (240 + 96 + 56) = 50176 <= 64K registers.
SOFTMAX_REGISTERS = 240
CORRECTION_REGISTERS = 96
CONTROL_REGISTERS = 56
MAX_BLOCK_N = 128  # a 256-column S row would not fit SOFTMAX_REGISTERS
MAX_HEAD_DIM = 256  # tcgen05.mma N <= 256 for O += P V
# e4m3: P V reads V^T tiles, chunks of this many keys (one 128-byte swizzle row of a V^T row;
# algo/v_transpose.cuh), so block_n is a multiple of it.
E4M3_KEYS_PER_CHUNK = 128


def tmem_allocation(columns: int) -> int:
    """tcgen05.alloc takes a power of two in [32, 512]."""
    allocation = 32
    while allocation < columns:
        allocation *= 2
    return allocation


class Fa4Tile(SoftmaxTricksTile):
    ALGORITHM: ClassVar[str] = "fa4 fwd"

    block_m: int = Field(gt=0, description=f"query rows per CTA: {BLOCK_M}")
    block_n: int = Field(gt=0, description="key rows per K/V tile")
    warps: int = Field(gt=0, description=f"warps per CTA: {WARPS} (the role table)")
    stages: int = Field(gt=0, description="K/V shared-memory ring depth")


@dataclass(frozen=True)
class Fa4Geometry(TmaRingLayout):
    # The paged layout: the idle warps zero the V rows a page holds past a batch row's keys
    # (fa4/forward.cuh: clear_cache_rows_past_keys), behind one more mbarrier.
    clears_cache_rows: bool = field(default=False, kw_only=True)

    @property
    def fixed_mbarriers(self) -> int:
        return FIXED_MBARRIERS + (1 if self.clears_cache_rows else 0)

    @property
    def smem_control_bytes(self) -> int:
        barriers = 8 * (self.fixed_mbarriers + MBARRIERS_PER_STAGE * self.stages)
        return barriers + TMEM_SLOT_BYTES + ROW_FLOATS * self.block_m * 4

    @property
    def tmem_columns_used(self) -> int:
        """Two fp32 S buffers (P aliases them) and the fp32 O accumulator (head_dim_v)."""
        return 2 * self.block_n + self.head_dim_v

    @property
    def tmem_columns(self) -> int:
        return tmem_allocation(self.tmem_columns_used)

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.block_m != BLOCK_M:
            out.append(f"tile.block_m={self.block_m}: must be {BLOCK_M} (one M=128 MMA, a TMEM "
                       "lane per query row)")
        if self.block_n % 32 or not (32 <= self.block_n <= MAX_BLOCK_N):
            out.append(f"tile.block_n={self.block_n}: must be a multiple of 32 in [32, "
                       f"{MAX_BLOCK_N}] (softmax holds a whole S row in registers)")
        if self.warps != WARPS:
            out.append(f"tile.warps={self.warps}: the FA4 role table has {WARPS} warps "
                       "(4 softmax, 4 correction, load, MMA, 2 idle)")
        if not (STAGE_RANGE[0] <= self.stages <= STAGE_RANGE[1]):
            out.append(f"tile.stages={self.stages}: must be in [{STAGE_RANGE[0]}, {STAGE_RANGE[1]}]")
        if self.element_bytes == 1:
            chunk_columns = TMA_COLUMNS * 2
            for name, dim in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
                if dim % chunk_columns:
                    out.append(f"{name}={dim}: e4m3 tiles need a multiple of {chunk_columns} (a 128-byte "
                               "swizzle row of e4m3)")
            if self.block_n % E4M3_KEYS_PER_CHUNK:
                out.append(f"tile.block_n={self.block_n}: e4m3 needs a multiple of {E4M3_KEYS_PER_CHUNK} (V^T "
                           "tiles are chunks of that many keys)")
        if out:
            return out
        if self.tmem_columns_used > TMEM_COLUMNS:
            out.append(
                f"tile (block_n={self.block_n}) needs {self.tmem_columns_used} TMEM columns at "
                f"{self.head_dims} (2 x block_n for S, head_dim_v for O); an SM has "
                f"{TMEM_COLUMNS}"
            )
        out.extend(smem_limit_problems(self, max_smem))
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA4 tile can take `head_dim`, or None."""
    if head_dim % TMA_COLUMNS or not 0 < head_dim <= MAX_HEAD_DIM:
        return (f"head_dim={head_dim}: the FA4 template needs a multiple of {TMA_COLUMNS} "
                f"(128-byte swizzle atoms) up to {MAX_HEAD_DIM} (tcgen05.mma N)")
    return None


# ---- FA4 forward (tcgen05 + TMEM, sm100a): 128 query rows, 12 role warps. Not yet run on a
# B200: the numbers below are derived, not measured. In every row rescale_threshold 8 is the
# FA4 paper's log2(256): probabilities stay <= 256, harmless for fp32 O and l. exp2_emulation
# 1/4: MUFU does 16 exp2/clk/SM, the FMA pipe 128 ops/clk/SM and the polynomial costs ~7
# ops, so the pipes would balance near 1/2; the FMA pipe also carries the scale, max, sum
# and conversions, hence a conservative 1/4 until measured. ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa4Tile(block_m=128, block_n=128, warps=12, stages=4, exp2_emulation=0.25,
                      rescale_threshold=8.0), 64,
              "S x2 + O = 320 TMEM columns (512 allocated); 148 KB smem: 4 stages of 32 KB K+V "
              "hide TMA latency behind two blocks of MMA"),
    TuningRow(Fa4Tile(block_m=128, block_n=128, warps=12, stages=3, exp2_emulation=0.25,
                      rescale_threshold=8.0), 128,
              "FA4 paper's 128x128 tile: S x2 + O = 384 TMEM columns; Q 32 KB + 3 stages x 64 KB "
              "K+V = 227 KB minus 320 bytes: the deepest ring that fits"),
    TuningRow(Fa4Tile(block_m=128, block_n=64, warps=12, stages=2, exp2_emulation=0.25,
                      rescale_threshold=8.0), 256,
              "block_n 128 would need 2 x 128 + 256 = 512 TMEM columns and 2 stages of 128 KB; "
              "block_n 64: 384 columns, 199 KB smem at head_dim 256"),
    # ---- e4m3 (FP8): K and V^T per stage, 1-byte rows; no conditional rescale (P, offset to
    # reach 256 for e4m3's mantissa, would pass 448 under a lagging reference).
    TuningRow(Fa4Tile(block_m=128, block_n=128, warps=12, stages=4, exp2_emulation=0.25), 128,
              "e4m3: Q 16 KB + 4 stages of K and V^T 32 KB = 144 KB, the bf16 hd64 row's ring depth "
              "for the same bytes per block; TMEM S x2 + O = 384 columns",
              dtypes=("e4m3",)),
    TuningRow(Fa4Tile(block_m=128, block_n=128, warps=12, stages=3, exp2_emulation=0.25), 256,
              "e4m3: S x2 + O = 512 TMEM columns; Q 32 KB + 3 stages of K and V^T 64 KB = 224 KB, "
              "the deepest ring that fits",
              dtypes=("e4m3",)),
)


class Fa4ForwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(
        value_dim_rule(head_dim_problem, "the epilogue stages O through the Q tile"))
    FA_VERSION: ClassVar[int] = 4
    DIRECTION: ClassVar[str] = "fwd"
    TEMPLATE: ClassVar[str] = "fa4_fwd_sm100.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = (Arch.sm100a,)
    WHY_ARCHS: ClassVar[str] = "tcgen05 (MMA into Tensor Memory) exists only on sm_100a"
    # UTCHMMA: tcgen05.mma kind::f16 (UTCQMMA: kind::f8f6f4); LDTM: tcgen05.ld; UTCBAR:
    # tcgen05.commit.
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("UTCHMMA", "LDTM", "UTCBAR", "UTMALDG")
    WHY_MASKS: ClassVar[str] = "custom masks: the FA2 forward takes them"
    # paged: a KV-cache call's prefill (fagen/runtime/kvcache.py), K/V tiles by TMA through the
    # block table in runs of keys (contract.cache_box_rows), as FA3's TMA path.
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen", "paged")
    DTYPES: ClassVar[tuple[str, ...]] = contract.DTYPES

    fa_version: Literal[4]
    direction: Literal["fwd"] = "fwd"
    tile: Fa4Tile

    @model_validator(mode="after")
    def _check_e4m3_variant(self) -> "Fa4ForwardSpec":
        """e4m3 kernels as FA3 builds them (KernelSpec.e4m3_variant_problem), and no conditional
        rescale, which would let the offset P pass e4m3's 448."""
        if self.dtype != "e4m3":
            return self
        if problem := self.e4m3_variant_problem():
            raise ValueError(problem)
        if self.tile.rescale_threshold is not None:
            raise ValueError("tile.rescale_threshold: not with e4m3 (P, offset to reach 256, would pass 448 "
                             "while the reference maximum lags)")
        return self

    @property
    def required_sass(self) -> tuple[str, ...]:
        """e4m3's tcgen05.mma (kind::f8f6f4) is UTCQMMA in SASS."""
        if self.dtype == "e4m3":
            return tuple("UTCQMMA" if family == "UTCHMMA" else family for family in self.REQUIRED_SASS)
        return self.REQUIRED_SASS

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa4Tile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa4Geometry:
        return Fa4Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                           head_dim_v=head_dim_v,
                           element_bytes=contract.DTYPE_BYTES[dtype])

    @property
    def geometry(self) -> Fa4Geometry:
        """geometry_of, with the paged layout's clearing of cache rows past the keys."""
        geometry = self.geometry_of(self.head_dim, self.tile, self.head_dim_v, self.dtypes)
        return replace(geometry, clears_cache_rows=self.layout == "paged")

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kTmemColumns", g.tmem_columns),
            Constexpr("kSoftmaxRegisters", SOFTMAX_REGISTERS),
            Constexpr("kCorrectionRegisters", CORRECTION_REGISTERS),
            Constexpr("kControlRegisters", CONTROL_REGISTERS),
            Constexpr("kSmemQOffset", g.smem_q_offset),
            Constexpr("kSmemKOffset", g.smem_k_offset),
            Constexpr("kSmemVOffset", g.smem_v_offset),
            Constexpr("kSmemBarrierOffset", g.smem_barrier_offset),
            Constexpr("kSmemControlBytes", g.smem_control_bytes),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kFixedBarriers", g.fixed_mbarriers),
            *paged_constexprs(self.layout),
            *self.tile.softmax_constexprs(),
            *v_transpose_constexprs(g.head_dim_v),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, dynamic_smem=g.smem_bytes,
                               tma_q_rows=g.block_m, tma_kv_rows=g.block_n)
