"""FA3 backward (wgmma + TMA, sm90a): its tile, geometry, template constexprs and launch.

One CTA per (key block, K/V head, batch), as the FA2 backward, with a producer warpgroup (TMA
loads, LSE/D loads, the dQ writer) and two consumer warpgroups of 64 keys each
(templates/include/fagen/fa3/backward.cuh); that is the kernel's structure, not an option. The geometry is computed once here: validation rejects tiles
that cannot fit, codegen passes the same numbers to the template, which re-checks them with
static_assert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import Arch
from .base import Constexpr, KernelSpec, TileBase
from .fa3 import Fa3ForwardSpec
from .layout import (
    ELEMENT_BYTES, SWIZZLE_ATOM_BYTES, TMA_COLUMNS, TileGeometry, consumer_registers, launch_registers,
    smem_limit_problems,
)

CONSUMERS = 2
# Registers after setmaxnreg: the producer warpgroup's three roles (TMA loads, LSE/D loads, the
# dQ writer) spilled at the forward's 24.
PRODUCER_REGISTERS = 32
CONSUMER_KEYS = 64  # wgmma m64: a consumer's dK, dV rows
# dS^T rows are block_m elements and must be one 128-byte swizzle atom wide (the dQ wgmma reads
# them MN-major), so a step is 64 queries.
BLOCK_M = TMA_COLUMNS
HEAD_DIMS = (64, 128)
# wgmma N values the kernel uses (templates/include/fagen/ptx/gen_wgmma.py writes their wrappers):
# block_m for S^T and dP^T, head_dim for dK and dV, head_dim / 2 for a consumer's dQ.
WGMMA_N = (32, 64, 128)  # dK + dV of 64 keys at head_dim 256 are 256 registers per thread
STAGE_CHOICES = (2, 3)
MBARRIERS = 1 + 2 * CONSUMERS  # kv_full, per consumer dq_full and dq_empty; and per stage:
MBARRIERS_PER_STAGE = 2  # full, empty
# Registers of a consumer thread beyond dK, dV, S^T, dP^T and the P^T fragments: descriptors,
# the walk, addresses. 20: head_dim 128 (128 + 64 + 16 = 208) compiles without spills under
# setmaxnreg 232.
REGISTER_OVERHEAD = 20


class Fa3BwdTile(TileBase):
    ALGORITHM: ClassVar[str] = "fa3 bwd"

    block_m: int = Field(BLOCK_M, gt=0, description="query rows per step of the walk (64)")
    block_n: int = Field(gt=0, description="keys per CTA: 64 per consumer warpgroup (128)")
    warps: int = Field(gt=0, description="warps per CTA: 8 consumer + 4 producer (12)")
    stages: int = Field(gt=0, description="Q / dO / LSE / D ring depth")

    STRUCTURE: ClassVar[dict[str, Any]] = {"warp_specialized": True}
    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = (("warp_specialized", "ws"),)


@dataclass(frozen=True)
class Fa3BwdGeometry(TileGeometry):
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
        ACCUM_BOX_COLUMNS)."""
        return self.block_m * self.dq_columns * contract.ACCUM_BYTES

    @property
    def smem_dq_offset(self) -> int:
        return self.smem_ds_offset + self.ds_buffers * self.ds_tile_bytes

    @property
    def smem_rows_offset(self) -> int:
        return self.smem_dq_offset + CONSUMERS * self.dq_stage_bytes

    @property
    def smem_barrier_offset(self) -> int:
        return self.smem_rows_offset + self.stages * 2 * self.block_m * 4  # LSE, D per stage

    @property
    def smem_bytes(self) -> int:
        control = 8 * (MBARRIERS + MBARRIERS_PER_STAGE * self.stages)
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
        """Per consumer thread: dK and dV (64 keys x head_dim each), S^T and dP^T (64 keys x
        block_m each) and the P^T fragments, live together before dS^T."""
        key_grads = 2 * CONSUMER_KEYS * self.head_dim // 128
        scores = 2 * CONSUMER_KEYS * self.block_m // 128
        return key_grads + scores + scores // 4 + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim={self.head_dim}: the FA3 backward takes {HEAD_DIMS} (dK + dV of "
                       f"{CONSUMER_KEYS} keys per consumer fit its registers there)")
        if self.block_m != BLOCK_M:
            out.append(f"tile.block_m={self.block_m}: must be {BLOCK_M} (dS^T rows are one "
                       "128-byte swizzle atom)")
        if self.block_n != CONSUMERS * CONSUMER_KEYS:
            out.append(f"tile.block_n={self.block_n}: must be {CONSUMERS * CONSUMER_KEYS} "
                       f"({CONSUMERS} consumer warpgroups of {CONSUMER_KEYS} keys)")
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


class Fa3BackwardSpec(KernelSpec):
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
    def geometry_of(head_dim: int, tile: Fa3BwdTile) -> Fa3BwdGeometry:
        return Fa3BwdGeometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages)

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kDsBuffers", g.ds_buffers),
            Constexpr("kProducerRegisters", PRODUCER_REGISTERS),
            Constexpr("kConsumerRegisters", g.consumer_registers),
            Constexpr("kLaunchRegisters", g.launch_registers),
            Constexpr("kSmemKOffset", g.smem_k_offset),
            Constexpr("kSmemVOffset", g.smem_v_offset),
            Constexpr("kSmemQOffset", g.smem_q_offset),
            Constexpr("kSmemDoOffset", g.smem_do_offset),
            Constexpr("kSmemDsOffset", g.smem_ds_offset),
            Constexpr("kSmemDqOffset", g.smem_dq_offset),
            Constexpr("kSmemRowsOffset", g.smem_rows_offset),
            Constexpr("kSmemBarrierOffset", g.smem_barrier_offset),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kAccumBoxColumns", contract.ACCUM_BOX_COLUMNS),
            Constexpr("kBwdRowsPerCta", contract.BWD_ROWS_PER_CTA),
            Constexpr("kBwdRowThreads", contract.BWD_ROW_THREADS),
        ]

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, block_n=g.block_n,
                               dynamic_smem=g.smem_bytes, grid="key_blocks",
                               tma_q_rows=g.block_m, tma_kv_rows=g.block_n)
