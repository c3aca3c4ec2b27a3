"""FA3 backward (wgmma + TMA, sm90a): its tile, geometry, template constexprs and launch.

One CTA per (key block, K/V head, batch), as the FA2 backward, with a producer warpgroup (TMA
loads, LSE/D loads, the dQ writer) and two consumer warpgroups
(templates/include/fagen/fa3/backward.cuh); that is the kernel's structure, not an option. How
the consumers share a tile follows from the head dimension, through their registers:

- key split (head_dim 64, 128): each consumer owns 64 of the tile's 128 keys, with all the
  columns of their dK and dV in registers (2 x 64 x head_dim / 128 per thread);
- column split (head_dim 256, where the key split's dK + dV alone would be 256 registers): both
  consumers share the tile's 64 keys, each owns head_dim / 2 columns of dK and dV, each computes
  the scores of half the step's queries, and P^T and dS^T go through shared memory.

The geometry is computed once here: validation rejects tiles that cannot fit, codegen passes the
same numbers to the template, which re-checks them with static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import Arch
from .base import Constexpr, KernelSpec, TileBase
from .companions import backward_row_constexprs
from .fa3 import Fa3ForwardSpec
from .layout import (
    ELEMENT_BYTES, SWIZZLE_ATOM_BYTES, TMA_COLUMNS, TileGeometry, consumer_registers, launch_registers,
    smem_limit_problems,
)
from .tuning import TuningRow

CONSUMERS = 2
# Registers after setmaxnreg: the producer warpgroup's three roles (TMA loads, LSE/D loads, the
# dQ writer) spilled at the forward's 24. The varlen layout's carry their batch row (its first
# rows and lengths), and its dQ writer spilled 12 bytes at 32 (head_dim 256, causal and local);
# 40 leaves the consumers' 232 as they are ((3 x 168 - 40) / 2 = 232).
PRODUCER_REGISTERS = 32
VARLEN_PRODUCER_REGISTERS = 40
CONSUMER_KEYS = 64  # wgmma m64: a consumer's dK, dV rows
# dS^T rows are block_m elements and must be one 128-byte swizzle atom wide (the dQ wgmma reads
# them MN-major), so a step is 64 queries.
BLOCK_M = TMA_COLUMNS
HEAD_DIMS = (64, 128, 256)
# wgmma N values the kernel uses (templates/include/fagen/ptx/gen_wgmma.py writes their wrappers):
# S^T and dP^T: block_m (key split) or block_m / 2 (column split); dK and dV: head_dim (key
# split) or head_dim / 2 (column split); a consumer's dQ: head_dim / 2.
WGMMA_N = (32, 64, 128)
STAGE_CHOICES = (2, 3)
MBARRIERS_PER_STAGE = 2  # full, empty
# Registers of a consumer thread beyond dK, dV, S^T, dP^T and the P^T fragments: descriptors,
# the walk, addresses. 20: head_dim 128 (128 + 64 + 16 = 208) compiles without spills under
# setmaxnreg 232.
REGISTER_OVERHEAD = 20


class Fa3BwdTile(TileBase):
    ALGORITHM: ClassVar[str] = "fa3 bwd"

    block_m: int = Field(BLOCK_M, gt=0, description="query rows per step of the walk (64)")
    block_n: int = Field(gt=0, description="keys per CTA: 128 (key split: 64 per consumer "
                         "warpgroup) or 64 (column split, head_dim 256)")
    warps: int = Field(gt=0, description="warps per CTA: 8 consumer + 4 producer (12)")
    stages: int = Field(gt=0, description="Q / dO / LSE / D ring depth")

    STRUCTURE: ClassVar[dict[str, Any]] = {"warp_specialized": True}
    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = (("warp_specialized", "ws"),)


@dataclass(frozen=True)
class Fa3BwdGeometry(TileGeometry):
    @property
    def key_split_registers(self) -> int:
        """A consumer thread's registers under the key split: dK and dV (64 keys x head_dim each),
        S^T and dP^T (64 keys x block_m each) and the P^T fragments, live together before dS^T."""
        key_grads = 2 * CONSUMER_KEYS * self.head_dim // 128
        scores = 2 * CONSUMER_KEYS * self.block_m // 128
        return key_grads + scores + scores // 4 + REGISTER_OVERHEAD

    @property
    def column_split(self) -> bool:
        """Whether the consumers split the columns instead of the keys: when the key split does
        not fit a consumer's registers (head_dim 256)."""
        return self.key_split_registers > self.consumer_registers

    @property
    def block_n_of_split(self) -> int:
        return CONSUMER_KEYS if self.column_split else CONSUMERS * CONSUMER_KEYS

    @property
    def pt_buffers(self) -> int:
        """P^T tiles in shared memory: the column split's dV reads them (two, as dS^T); the key
        split's dV takes P^T from registers."""
        return self.ds_buffers if self.column_split else 0

    @property
    def ds_buffers(self) -> int:
        """Two dS^T buffers: a consumer's dQ reads the other's dS^T, and the next step writes the
        other buffer, so no second barrier is needed before it."""
        return 2

    @property
    def dq_columns(self) -> int:
        """A consumer's part of dQ: head_dim / 2 columns over all the CTA's keys. (With head_dim
        64 each consumer took all 64 columns over its own keys until run 83: two reductions of
        every element instead of one.)"""
        return self.head_dim // CONSUMERS

    @property
    def q_tile_bytes(self) -> int:
        return self.block_m * self.head_dim * ELEMENT_BYTES

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * ELEMENT_BYTES

    @property
    def ds_tile_bytes(self) -> int:
        return self.block_n * self.block_m * ELEMENT_BYTES

    @property
    def smem_k_offset(self) -> int:
        return 0

    @property
    def smem_v_offset(self) -> int:
        return self.kv_tile_bytes

    @property
    def smem_q_offset(self) -> int:
        return 2 * self.kv_tile_bytes

    @property
    def smem_do_offset(self) -> int:
        return self.smem_q_offset + self.stages * self.q_tile_bytes

    @property
    def smem_ds_offset(self) -> int:
        return self.smem_do_offset + self.stages * self.q_tile_bytes

    @property
    def dq_stage_bytes(self) -> int:
        """A consumer's dQ staging tile: block_m rows x its dQ columns, fp32 (boxes of
        ACCUM_BOX_COLUMNS). The column split stages dQ in the step's Q and dO tiles instead
        (a consumer's dQ part is the size of its columns of both), which leaves the room for
        two Q / dO stages: 224 KB at head_dim 256."""
        return 0 if self.column_split else self.block_m * self.dq_columns * contract.ACCUM_BYTES

    @property
    def dq_barriers(self) -> int:
        """The dQ handover's mbarriers. Key split: per consumer dq_full and dq_empty (its staging
        tile). Column split: per consumer and ring slot dq_full (the slot is the staging; one
        dq_full per consumer would let the consumers complete two of its phases while the
        deterministic writer waits for its turn, and the writer would miss one)."""
        return CONSUMERS * (self.stages if self.column_split else 2)

    @property
    def smem_pt_offset(self) -> int:
        return self.smem_ds_offset + self.ds_buffers * self.ds_tile_bytes

    @property
    def smem_dq_offset(self) -> int:
        return self.smem_pt_offset + self.pt_buffers * self.ds_tile_bytes

    @property
    def smem_rows_offset(self) -> int:
        return self.smem_dq_offset + CONSUMERS * self.dq_stage_bytes

    @property
    def smem_barrier_offset(self) -> int:
        return self.smem_rows_offset + self.stages * 2 * self.block_m * 4  # LSE, D per stage

    @property
    def smem_bytes(self) -> int:
        control = 8 * (1 + self.dq_barriers + MBARRIERS_PER_STAGE * self.stages)  # + kv_full
        # + one atom of slack: the kernel rounds the dynamic window up to 1024-byte alignment.
        return self.smem_barrier_offset + control + SWIZZLE_ATOM_BYTES

    @property
    def launch_registers(self) -> int:
        return launch_registers(self.threads)

    @property
    def consumer_registers(self) -> int:
        """(3 x 168 - 32) / 2 = 236, rounded down to setmaxnreg's granule: 232."""
        return consumer_registers(self.threads, CONSUMERS, PRODUCER_REGISTERS)

    @property
    def estimated_registers(self) -> int:
        """Per consumer thread. Column split: its columns of dK and dV (64 keys x head_dim / 2
        each) and of dQ (block_m x head_dim / 2), live together after the scores died."""
        if not self.column_split:
            return self.key_split_registers
        key_grads = 2 * CONSUMER_KEYS * self.dq_columns // 128
        dq = self.block_m * self.dq_columns // 128
        return key_grads + dq + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.block_m != BLOCK_M:
            out.append(f"tile.block_m={self.block_m}: must be {BLOCK_M} (dS^T rows are one "
                       "128-byte swizzle atom)")
        if self.warps == 4 * (CONSUMERS + 1) and self.block_n != self.block_n_of_split:
            split = ("the column split: both consumer warpgroups share 64 keys" if self.column_split
                     else f"{CONSUMERS} consumer warpgroups of {CONSUMER_KEYS} keys")
            out.append(f"tile.block_n={self.block_n}: must be {self.block_n_of_split} at "
                       f"head_dim={self.head_dim} ({split})")
        if self.warps != 4 * (CONSUMERS + 1):
            out.append(f"tile.warps={self.warps}: must be {4 * (CONSUMERS + 1)} (two consumer "
                       "warpgroups and the producer)")
        if self.stages not in STAGE_CHOICES:
            out.append(f"tile.stages={self.stages}: must be one of {STAGE_CHOICES}")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > self.consumer_registers:
            out.append(f"tile needs about {self.estimated_registers} registers per consumer "
                       f"thread at head_dim={self.head_dim}; consumers get {self.consumer_registers}")
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA3 backward tile can take `head_dim`, or None."""
    if head_dim not in HEAD_DIMS:
        return (f"head_dim={head_dim}: the FA3 backward takes {HEAD_DIMS} (whole TMA boxes of 64 "
                "columns, and a consumer's dK, dV columns one wgmma N)")
    return None


# ---- FA3 backward (wgmma + TMA, sm90a): one CTA per key block, two consumer warpgroups that
# split its keys (head dims 64, 128: 64 keys each, dK and dV in registers) or its columns
# (head dim 256), a producer warpgroup, steps of 64 queries (the kernel's structure,
# fagen/model/fa3_bwd.py). Speeds: H200 (2026-12-01), 2k / 8k. ----
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa3BwdTile(block_n=128, warps=12, stages=2), 64,
              "dK + dV 64, S^T + dP^T 64 regs per consumer thread; two Q / dO stages keep the "
              "next step's loads under this one's MMAs (a third with the rotated loop: 0.96-1.00x, "
              "run 87); 114 KB smem. 417 / 466 TFLOP/s non-causal, 315 / 401 causal at 2k / 8k "
              "(0.96-1.06x cuDNN, run 92)"),
    TuningRow(Fa3BwdTile(block_n=128, warps=12, stages=2), 128,
              "dK + dV 128, S^T + dP^T 64, P^T fragments 16 regs of the 232 a consumer gets; "
              "K, V 64 KB + 2 stages of Q, dO 64 KB + two dS^T buffers 32 KB + dQ staging 32 KB "
              "= 194 KB, so no third stage fits. 513 / 542 TFLOP/s non-causal, 400 / 517 causal "
              "at 2k / 8k (0.97-1.07x cuDNN, run 92)"),
    TuningRow(Fa3BwdTile(block_n=64, warps=12, stages=2), 256,
              "the column split (the key split's dK + dV alone would be 256 regs): 64 keys, each "
              "consumer 128 columns of dK, dV (128 regs) and dQ (64); K, V 64 KB + 2 stages of "
              "Q, dO 128 KB + P^T, dS^T 32 KB = 226 KB, dQ staged in the step's own Q / dO "
              "columns. 367 / 395 TFLOP/s non-causal, 324 / 400 causal at 2k / 8k (1.00-1.10x "
              "cuDNN, run 92)"),
)


class Fa3BackwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    # At head_dim 192 with head_dim_v 128 neither split fits: keys split, a consumer's dK and dV
    # (64 x 320 fp32) and S^T, dP^T need ~224 of its 240 registers before any overhead; columns
    # split, each consumer's 96 columns of dK and dQ start inside a 64-column swizzle chunk.
    # FA2's backward serves split head dims on Hopper.
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(
        lambda head_dim, head_dim_v: "its consumers split one head dim's dK, dV and dQ (the FA2 "
        "backward takes head_dim_v)")
    WHY_MASKS: ClassVar[str] = "custom masks: the FA2 backward takes them"
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen")
    FA_VERSION: ClassVar[int] = 3
    DIRECTION: ClassVar[str] = "bwd"
    TEMPLATE: ClassVar[str] = "fa3_bwd_sm90.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = Fa3ForwardSpec.ARCHS
    WHY_ARCHS: ClassVar[str] = Fa3ForwardSpec.WHY_ARCHS
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HGMMA", "UTMALDG", "UTMAREDG", "SYNCS")

    fa_version: Literal[3]
    direction: Literal["bwd"]
    tile: Fa3BwdTile

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa3BwdTile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa3BwdGeometry:
        return Fa3BwdGeometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages, head_dim_v=head_dim_v,
                              element_bytes=contract.DTYPE_BYTES[dtype])

    @property
    def producer_registers(self) -> int:
        producer = VARLEN_PRODUCER_REGISTERS if self.layout == "varlen" else PRODUCER_REGISTERS
        assert consumer_registers(self.geometry.threads, CONSUMERS, producer) == self.geometry.consumer_registers
        return producer

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kDsBuffers", g.ds_buffers),
            Constexpr("kPtBuffers", g.pt_buffers),
            Constexpr("kColumnSplit", g.column_split),
            Constexpr("kDqBarriers", g.dq_barriers),
            Constexpr("kProducerRegisters", self.producer_registers),
            Constexpr("kConsumerRegisters", g.consumer_registers),
            Constexpr("kLaunchRegisters", g.launch_registers),
            Constexpr("kSmemKOffset", g.smem_k_offset),
            Constexpr("kSmemVOffset", g.smem_v_offset),
            Constexpr("kSmemQOffset", g.smem_q_offset),
            Constexpr("kSmemDoOffset", g.smem_do_offset),
            Constexpr("kSmemDsOffset", g.smem_ds_offset),
            Constexpr("kSmemPtOffset", g.smem_pt_offset),
            Constexpr("kSmemDqOffset", g.smem_dq_offset),
            Constexpr("kSmemRowsOffset", g.smem_rows_offset),
            Constexpr("kSmemBarrierOffset", g.smem_barrier_offset),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kAccumBoxColumns", contract.ACCUM_BOX_COLUMNS),
            *backward_row_constexprs(),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, block_n=g.block_n,
                               dynamic_smem=g.smem_bytes, grid="key_blocks",
                               tma_q_rows=g.block_m, tma_kv_rows=g.block_n)
