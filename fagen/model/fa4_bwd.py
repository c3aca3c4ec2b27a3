"""FA4 backward (tcgen05 + TMEM + TMA, sm100a): its tile, geometry, template constexprs and
launch.

One CTA per (key block of 128 keys, K/V head, batch), as the FA2 and FA3 backward, walking the
query blocks of every query head its K/V head serves (templates/include/fagen/fa4/backward.cuh).
Every product is an M = 128 tcgen05.mma: S^T and dP^T (keys x queries) land in Tensor Memory,
where compute warps with one thread per key turn them into P^T and dS^T in place; dV and dK
accumulate in TMEM across the walk; dQ_i is written over dP^T's columns once dK_i has read dS^T,
and dQ warps with one thread per TMEM lane add it to the fp32 accumulator in global memory. TMEM
holds S^T, dP^T (block_m columns each), dV and dK (head_dim_v + head_dim): at head dims 64 and
128 a step is 128 queries and dQ_i = dS K (a lane per query, head_dim <= 128 columns over dP^T);
DeepSeek-V3's 192 / 128 leaves 192 columns for S^T and dP^T, and the softcap's 1 - u^2 per score
the compute threads no registers for 128 queries, so their steps are 64 queries, and dQ_i^T =
K^T dS^T (a lane per head-dim column: M = 64 queries is no full-lane MMA) is M = 128 products
(over dims [0, 128) and [64, 192) at 192) in dP^T's columns and the next ones.

The geometry is computed once here: validation rejects tiles that cannot fit shared memory or
TMEM, codegen passes the same numbers to the template, which re-checks them with static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .. import contract
from .arch import Arch
from .base import Constexpr, KernelSpec, TileBase
from .companions import backward_row_constexprs
from .fa4 import TMEM_COLUMNS, Fa4ForwardSpec, tmem_allocation
from .layout import (
    ELEMENT_BYTES, SETMAXNREG_GRANULE, SWIZZLE_ATOM_BYTES, TMA_COLUMNS, TileGeometry, launch_registers,
    smem_limit_problems,
)
from .tuning import TuningRow

BLOCK_M = 128  # queries per step: N of S^T and dP^T, M of dQ (a TMEM lane per query)
SPLIT_BLOCK_M = 64  # queries per step at 192 / 128 and softcap: N of S^T, dP^T, dQ^T (a lane per dim)
BLOCK_N = 128  # keys per CTA: M of S^T, dP^T, dV, dK (a TMEM lane per key)
MMA_M = 128  # the M of every product: a TMEM lane per row, all 128 lanes
# Role warps (templates/include/fagen/fa4/backward.cuh): 4 compute (a key row each), 4 dQ (a
# TMEM lane of dQ each: a query, or a head-dim column of dQ^T; dK and dV at the end), then load, MMA and 2 idle warps completing the third
# warpgroup (setmaxnreg acts on whole warpgroups).
WARPS = 12
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (192, 128))  # (head_dim, head_dim_v)
HEAD_DIMS = tuple(d for d, _ in HEAD_DIM_PAIRS)
STAGE_RANGE = (2, 4)
# kv_full, s_full, p_full, dp_full, ds_full, dq_full, dq_empty, grads_done; then per Q / dO
# stage full and empty.
FIXED_MBARRIERS = 8
MBARRIERS_PER_STAGE = 2
TMEM_SLOT_BYTES = 16  # the TMEM base address tcgen05.alloc writes, padded to 16 bytes
# Registers after setmaxnreg, per thread. A compute thread keeps its key's 128 probabilities of a
# step (fp32) from P^T to dS^T, and loads dP^T 32 columns at a time; a dQ thread loads its
# query's whole dQ row (head_dim fp32) before it frees TMEM; the load and MMA lanes need
# addresses and loop state only. 240 + 208 + 56 = 504 = 3 x 168, what the launch gives 384
# threads.
COMPUTE_REGISTERS = 240
DQ_REGISTERS = 208
CONTROL_REGISTERS = 56


class Fa4BwdTile(TileBase):
    ALGORITHM: ClassVar[str] = "fa4 bwd"

    block_m: int = Field(BLOCK_M, gt=0, description=f"query rows per step of the walk ({BLOCK_M}; "
                         f"{SPLIT_BLOCK_M} at head dims 192 / 128 and with the softcap)")
    block_n: int = Field(BLOCK_N, gt=0, description=f"keys per CTA ({BLOCK_N})")
    warps: int = Field(WARPS, gt=0, description=f"warps per CTA: {WARPS} (the role table)")
    stages: int = Field(gt=0, description="Q / dO shared-memory ring depth")


@dataclass(frozen=True)
class Fa4BwdGeometry(TileGeometry):
    @property
    def key_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * ELEMENT_BYTES

    @property
    def value_tile_bytes(self) -> int:
        return self.block_n * self.head_dim_v * ELEMENT_BYTES

    @property
    def q_tile_bytes(self) -> int:
        return self.block_m * self.head_dim * ELEMENT_BYTES

    @property
    def do_tile_bytes(self) -> int:
        return self.block_m * self.head_dim_v * ELEMENT_BYTES

    @property
    def ds_tile_bytes(self) -> int:
        """dS^T for dQ's A operand: block_n key rows of block_m queries."""
        return self.block_n * self.block_m * ELEMENT_BYTES

    @property
    def smem_k_offset(self) -> int:
        return 0

    @property
    def smem_v_offset(self) -> int:
        return self.key_tile_bytes

    @property
    def smem_q_offset(self) -> int:
        return self.smem_v_offset + self.value_tile_bytes

    @property
    def smem_do_offset(self) -> int:
        return self.smem_q_offset + self.stages * self.q_tile_bytes

    @property
    def smem_ds_offset(self) -> int:
        return self.smem_do_offset + self.stages * self.do_tile_bytes

    @property
    def smem_barrier_offset(self) -> int:
        return self.smem_ds_offset + self.ds_tile_bytes

    @property
    def smem_control_bytes(self) -> int:
        return 8 * (FIXED_MBARRIERS + MBARRIERS_PER_STAGE * self.stages) + TMEM_SLOT_BYTES

    @property
    def smem_bytes(self) -> int:
        # + one atom of slack: the kernel rounds the dynamic window up to 1024-byte alignment.
        return self.smem_barrier_offset + self.smem_control_bytes + SWIZZLE_ATOM_BYTES

    @property
    def dq_transposed(self) -> bool:
        """dQ_i^T = K^T dS^T (a TMEM lane per head-dim column) where a step has fewer queries than
        an MMA has lanes; else dQ_i = dS K (a lane per query)."""
        return self.block_m < MMA_M

    @property
    def dq_products(self) -> int:
        """The M = 128 products of dQ_i^T: dims [0, 128), ..., the last ending at head_dim (over
        dims an earlier one has: [64, 192) at 192)."""
        return -(-self.head_dim // MMA_M) if self.dq_transposed else 1

    @property
    def dq_columns(self) -> int:
        return self.dq_products * self.block_m if self.dq_transposed else self.head_dim

    @property
    def tmem_dp_column(self) -> int:
        return self.block_m  # after S^T; dS^T over its first half, dQ_i from here

    @property
    def tmem_dv_column(self) -> int:
        return self.tmem_dp_column + max(self.block_m, self.dq_columns)

    @property
    def tmem_dk_column(self) -> int:
        return self.tmem_dv_column + self.head_dim_v

    @property
    def tmem_columns_used(self) -> int:
        """S^T (block_m fp32 columns; P^T aliases it), dP^T or dQ_i (dS^T and dQ alias dP^T; dQ_i
        may reach past it), dV and dK (head_dim_v and head_dim)."""
        return self.tmem_dk_column + self.head_dim

    @property
    def tmem_columns(self) -> int:
        return tmem_allocation(self.tmem_columns_used)

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim) or head_dim_v_problem(self.head_dim, self.head_dim_v):
            out.append(problem)
        if self.block_m not in (BLOCK_M, SPLIT_BLOCK_M):
            out.append(f"tile.block_m={self.block_m}: must be {BLOCK_M} (dQ one M = 128 MMA, a TMEM "
                       f"lane per query) or {SPLIT_BLOCK_M} (dQ^T, a lane per head-dim column)")
        elif self.block_m < MMA_M and self.head_dim < MMA_M:
            out.append(f"tile.block_m={self.block_m} at head_dim={self.head_dim}: dQ^T's products have "
                       f"M = {MMA_M} head-dim columns")
        if self.block_n != BLOCK_N:
            out.append(f"tile.block_n={self.block_n}: must be {BLOCK_N} (S^T is one M = 128 MMA, a "
                       "TMEM lane per key)")
        if self.warps != WARPS:
            out.append(f"tile.warps={self.warps}: the FA4 backward's role table has {WARPS} warps "
                       "(4 compute, 4 dQ, load, MMA, 2 idle)")
        if not (STAGE_RANGE[0] <= self.stages <= STAGE_RANGE[1]):
            out.append(f"tile.stages={self.stages}: must be in [{STAGE_RANGE[0]}, {STAGE_RANGE[1]}]")
        if out:
            return out
        if self.tmem_columns_used > TMEM_COLUMNS:
            out.append(f"tile needs {self.tmem_columns_used} TMEM columns at {self.head_dims}; an SM "
                       f"has {TMEM_COLUMNS}")
        out.extend(smem_limit_problems(self, max_smem))
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA4 backward tile can take `head_dim`, or None."""
    if head_dim not in HEAD_DIMS:
        return (f"head_dim={head_dim}: the FA4 backward takes {HEAD_DIMS} (S^T, dP^T, dV and dK "
                f"share TMEM's {TMEM_COLUMNS} columns); the FA2 backward serves the others on sm100a")
    return None


def head_dim_v_problem(head_dim: int, head_dim_v: int) -> str | None:
    """Why no FA4 backward tile can take v head dim `head_dim_v` beside `head_dim`, or None."""
    if (head_dim, head_dim_v) not in HEAD_DIM_PAIRS:
        return (f"the FA4 backward takes (head_dim, head_dim_v) in {HEAD_DIM_PAIRS} (TMEM's "
                f"{TMEM_COLUMNS} columns hold dK and dV beside S^T and dP^T)")
    return None


# ---- FA4 backward (tcgen05 + TMEM, sm100a): 128 keys per CTA, steps of 128 queries, 12 role
# warps. Not yet run on a B200: the choices below are derived, not measured. ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa4BwdTile(stages=3), 64,
              "K, V 32 KB + 3 stages of Q, dO 96 KB + dS^T 32 KB = 161 KB: the loads of the next "
              "two steps in flight under one step's five MMAs; TMEM 384 columns"),
    TuningRow(Fa4BwdTile(stages=2), 128,
              "K, V 64 KB + 2 stages of Q, dO 128 KB + dS^T 32 KB = 225 KB, the deepest ring "
              "that fits 227 KB; TMEM 512 columns"),
    TuningRow(Fa4BwdTile(block_m=SPLIT_BLOCK_M, stages=4), 128,
              "softcap: a compute thread keeps 1 - u^2 beside each probability of a step, 2 x 64 "
              "fp32 (2 x 128 would not fit its 240 registers), so steps of 64 queries and dQ^T; "
              "K, V 64 KB + 4 stages of Q, dO 128 KB + dS^T 16 KB = 209 KB; TMEM 384 columns",
              score=("softcap",)),
    TuningRow(Fa4BwdTile(block_m=SPLIT_BLOCK_M, stages=3), 192,
              "dK 192 + dV 128 TMEM columns leave 192: S^T and dP^T of 64 queries and dQ^T's two "
              "products over dP^T and the next 64 (512 in all); K, V 80 KB + 3 stages of Q, dO "
              "120 KB + dS^T 16 KB = 217 KB, the deepest ring that fits 227 KB",
              head_dim_v=128),
)


class Fa4BackwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(head_dim_v_problem)
    FA_VERSION: ClassVar[int] = 4
    DIRECTION: ClassVar[str] = "bwd"
    TEMPLATE: ClassVar[str] = "fa4_bwd_sm100.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = Fa4ForwardSpec.ARCHS
    WHY_ARCHS: ClassVar[str] = Fa4ForwardSpec.WHY_ARCHS
    # UTCHMMA: tcgen05.mma kind::f16; LDTM / STTM: tcgen05.ld / st; UTCBAR: tcgen05.commit.
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("UTCHMMA", "LDTM", "STTM", "UTCBAR", "UTMALDG")
    MASKS: ClassVar[tuple[str, ...]] = contract.MASKS
    WHY_MASKS: ClassVar[str] = "custom masks: the FA2 backward takes them"
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen")
    SCORE_MODS: ClassVar[tuple[str, ...]] = contract.SCORE_MODS

    fa_version: Literal[4]
    direction: Literal["bwd"]
    tile: Fa4BwdTile

    @model_validator(mode="after")
    def _check_softcap_step(self) -> "Fa4BackwardSpec":
        """A softcap step keeps 1 - u^2 beside each fp32 probability of its compute thread's key:
        2 x block_m registers, which only block_m 64 leaves room for (COMPUTE_REGISTERS)."""
        if "softcap" in self.score and self.tile.block_m != SPLIT_BLOCK_M:
            raise ValueError(f"score=softcap needs tile.block_m={SPLIT_BLOCK_M} (1 - u^2 beside each "
                             f"probability: 2 x {self.tile.block_m} fp32 per compute thread do not fit "
                             f"its {COMPUTE_REGISTERS} registers), and that step head_dim >= {MMA_M} "
                             f"(dQ^T's products have M = {MMA_M} head-dim columns); the FA2 backward "
                             "takes the others")
        return self

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa4BwdTile, head_dim_v: int | None = None,
                    dtype: str = "bf16") -> Fa4BwdGeometry:
        return Fa4BwdGeometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                              head_dim_v=head_dim_v, element_bytes=contract.DTYPE_BYTES[dtype])

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        assert COMPUTE_REGISTERS + DQ_REGISTERS + CONTROL_REGISTERS <= 3 * launch_registers(g.threads)
        assert all(r % SETMAXNREG_GRANULE == 0 for r in (COMPUTE_REGISTERS, DQ_REGISTERS, CONTROL_REGISTERS))
        assert g.head_dim % TMA_COLUMNS == 0
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kTmemColumns", g.tmem_columns),
            Constexpr("kDqTransposed", g.dq_transposed),
            Constexpr("kDqProducts", g.dq_products),
            Constexpr("kTmemDvColumn", g.tmem_dv_column),
            Constexpr("kTmemDkColumn", g.tmem_dk_column),
            Constexpr("kComputeRegisters", COMPUTE_REGISTERS),
            Constexpr("kDqRegisters", DQ_REGISTERS),
            Constexpr("kControlRegisters", CONTROL_REGISTERS),
            Constexpr("kLaunchRegisters", launch_registers(g.threads)),
            Constexpr("kSmemKOffset", g.smem_k_offset),
            Constexpr("kSmemVOffset", g.smem_v_offset),
            Constexpr("kSmemQOffset", g.smem_q_offset),
            Constexpr("kSmemDoOffset", g.smem_do_offset),
            Constexpr("kSmemDsOffset", g.smem_ds_offset),
            Constexpr("kSmemBarrierOffset", g.smem_barrier_offset),
            Constexpr("kSmemControlBytes", g.smem_control_bytes),
            Constexpr("kSmemBytes", g.smem_bytes),
            *backward_row_constexprs(),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, block_n=g.block_n,
                               dynamic_smem=g.smem_bytes, grid="key_blocks",
                               tma_q_rows=g.block_m, tma_kv_rows=g.block_n)
