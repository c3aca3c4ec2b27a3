"""Geometry of the FA3 forward kernel (wgmma + TMA, sm90a), computed once here.

Validation rejects tiles that cannot fit; codegen passes the same numbers to the template,
which re-checks them with static_assert.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM
from .layout import (
    ELEMENT_BYTES, MBARRIERS_PER_STAGE, TMA_COLUMNS, TmaRingLayout, smem_limit_problems,
)

CONSUMER_ROWS = 64  # wgmma m64: one consumer warpgroup owns 64 query rows
# wgmma N values templates/include/fagen/ptx/gen_wgmma.py generates wrappers for: the block_n and
# head_dim values the tuning table uses, and head_dim + 8 for mma_row_sum's P V.
WGMMA_N = (64, 72, 80, 96, 128, 136, 160, 176, 192, 256)
WGMMA_MAX_N = 256
# mma_row_sum: P V runs over one more n8 tile of V, whose columns are all ones, so that tile of
# O holds the row sums of P.
ROW_SUM_COLUMNS = 8

# Registers after setmaxnreg (FlashAttention-3 paper, section 3.1: the producer needs almost
# none). Consumers share the rest of the 64K: 24 + 2 x 240 = 504 per thread-slot of 128 threads
# with two consumer warpgroups, 24 + 3 x 160 = 504 with three.
PRODUCER_REGISTERS = 24
SETMAXNREG_GRANULE = 8  # setmaxnreg counts are multiples of 8
# Registers of a consumer thread beyond S, O and P: softmax state, descriptors, loop state.
# 28: hd64 m192n128 with mma_row_sum (S 64 + O and row sums 36 + P 32 = 132) compiles without
# spills under setmaxnreg 160.
REGISTER_OVERHEAD = 28
# Hopper (sm_90): 228 KB of shared memory per SM, of which each resident CTA reserves 1 KB
# (CUDA C Programming Guide, compute capability 9.0 and "Shared Memory").
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
MBARRIERS_PER_Q_STAGE = 2  # q_full, q_empty


@dataclass(frozen=True)
class Fa3Geometry(TmaRingLayout):
    warp_specialized: bool
    pingpong: bool
    intra_wg_overlap: bool
    persistent: bool
    early_first_qk: bool
    peel_masked_blocks: bool
    mma_row_sum: bool

    @property
    def consumers(self) -> int:
        return self.block_m // CONSUMER_ROWS

    @property
    def expected_warps(self) -> int:
        return 4 * (self.consumers + (1 if self.warp_specialized else 0))

    @property
    def q_stages(self) -> int:
        """early_first_qk issues a tile's first Q K^T before the previous tile's epilogue, so
        that tile's Q must be in shared memory by then: with one Q buffer it is loaded only
        after the previous tile's last Q K^T, and the epilogue waited for it (run 44: -2...-6 %
        at hd64). A second buffer lets the producer load it a whole tile ahead."""
        return 2 if self.early_first_qk else 1

    @property
    def pv_columns(self) -> int:
        """N of the P V wgmma: head_dim, plus the column tile of ones with mma_row_sum."""
        return self.head_dim + (ROW_SUM_COLUMNS if self.mma_row_sum else 0)

    @property
    def smem_v_stage_bytes(self) -> int:
        """mma_row_sum: each V tile is followed by a 64-column chunk of ones (block_n rows of
        128 bytes, all of them ones so that the swizzle cannot pick a wrong column), which the
        P V wgmma reads as its columns head_dim ... head_dim + 7: the chunk after V's last one,
        at the same chunk stride."""
        ones_chunk = self.block_n * TMA_COLUMNS * ELEMENT_BYTES if self.mma_row_sum else 0
        return self.smem_kv_tile_bytes + ones_chunk

    @property
    def smem_control_bytes(self) -> int:
        return 8 * (MBARRIERS_PER_Q_STAGE * self.q_stages + MBARRIERS_PER_STAGE * self.stages)

    @property
    def ctas_per_sm(self) -> int:
        """Two CTAs per SM for warp-specialized tiles with one consumer warpgroup (64 query rows)
        whose shared memory allows it: each CTA then has the register file half of a
        two-consumer CTA, and the two CTAs' tile boundaries (first Q K^T, last P V, epilogue)
        fall at different times, so one CTA's MMAs fill the other's gaps. Measured 35-50 %
        faster than one such CTA per SM, but still below the two-consumer tiles (run 23), so no
        tuning-table row uses 64-row tiles."""
        two_fit = 2 * (self.smem_bytes + SMEM_RESERVED_PER_CTA) <= SMEM_PER_SM
        return 2 if self.consumers == 1 and self.warp_specialized and two_fit else 1

    @property
    def consumer_registers(self) -> int:
        registers_per_cta = REGISTERS_PER_SM // self.ctas_per_sm
        if not self.warp_specialized:
            per_thread = registers_per_cta // (128 * self.consumers)
            return min(MAX_REGISTERS_PER_THREAD, per_thread)
        share = (registers_per_cta // 128 - PRODUCER_REGISTERS) // self.consumers
        return min(MAX_REGISTERS_PER_THREAD, share) // SETMAXNREG_GRANULE * SETMAXNREG_GRANULE

    @property
    def estimated_registers(self) -> int:
        """Per consumer thread: O and S accumulators and the P fragments (with intra-warpgroup
        overlap, P of block j-1 is live while S of block j accumulates: that is this term)."""
        acc_o = self.pv_columns // 2
        acc_s = self.block_n // 2
        p_fragments = self.block_n // 4
        return acc_o + acc_s + p_fragments + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if self.head_dim % TMA_COLUMNS or self.head_dim not in WGMMA_N:
            out.append(
                f"head_dim={self.head_dim}: the FA3 template needs a multiple of {TMA_COLUMNS} "
                f"(128-byte swizzle atoms) that is a wgmma N in {WGMMA_N}"
            )
        if self.block_m % CONSUMER_ROWS or self.consumers not in (1, 2, 3):
            out.append(f"tile.block_m={self.block_m}: must be 64, 128 or 192 (one to three consumer "
                       "warpgroups)")
        if self.block_n not in WGMMA_N:
            out.append(f"tile.block_n={self.block_n}: must be a wgmma N in {WGMMA_N}")
        if not out and self.warps != self.expected_warps:
            out.append(
                f"tile.warps={self.warps}: block_m={self.block_m} with warp_specialized="
                f"{self.warp_specialized} needs {self.expected_warps} warps"
            )
        if self.persistent and not self.warp_specialized:
            out.append("tile.persistent: needs warp_specialized (the producer loads the next tile)")
        if self.early_first_qk and not (self.persistent and self.intra_wg_overlap
                                        and not self.pingpong):
            out.append("tile.early_first_qk: needs persistent and intra_wg_overlap, without "
                       "pingpong (a consumer issues the next tile's first Q K^T on its own)")
        if self.peel_masked_blocks and not self.intra_wg_overlap:
            out.append("tile.peel_masked_blocks: needs intra_wg_overlap (the loop it splits)")
        if self.mma_row_sum and self.pv_columns > WGMMA_MAX_N:
            out.append(f"tile.mma_row_sum: P V would need N = {self.pv_columns} > {WGMMA_MAX_N} "
                       f"at head_dim={self.head_dim}")
        elif self.mma_row_sum and self.pv_columns not in WGMMA_N:
            out.append(f"tile.mma_row_sum: no wgmma wrapper for N = {self.pv_columns}")
        if self.pingpong and self.consumers != 2:
            out.append("tile.pingpong: needs two consumer warpgroups (block_m=128)")
        if not (2 <= self.stages <= 4):
            out.append(f"tile.stages={self.stages}: must be in [2, 4]")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > self.consumer_registers:
            out.append(
                f"tile (block_n={self.block_n}) needs about {self.estimated_registers} registers "
                f"per consumer thread at head_dim={self.head_dim}; consumers get "
                f"{self.consumer_registers}"
            )
        return out
