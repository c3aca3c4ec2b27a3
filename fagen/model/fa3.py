"""FA3 forward (wgmma + TMA, sm90a): its tile, geometry, template constexprs and launch.

Every FA3 kernel has a producer warpgroup (warp specialization), overlaps each warpgroup's
softmax with its previous P V, and runs on a persistent grid: that is the kernel's structure
(templates/include/fagen/fa3/forward.cuh), not options. The geometry is computed once here:
validation rejects tiles that cannot fit, codegen passes the same numbers to the template, which
re-checks them with static_assert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from .. import contract
from .arch import Arch
from .base import Constexpr, KernelSpec, SoftmaxTricksTile
from .companions import paged_constexprs, v_transpose_constexprs
from .layout import (
    MBARRIERS_PER_STAGE, SWIZZLE_ROW_BYTES, TMA_COLUMNS, TmaRingLayout, consumer_registers,
    smem_limit_problems, value_dim_rule,
)
from .tuning import TuningRow

CONSUMER_ROWS = 64  # wgmma m64: one consumer warpgroup owns 64 query rows
# wgmma N values templates/include/fagen/ptx/gen_wgmma.py generates wrappers for: the block_n and
# head_dim values the tuning table uses, and head_dim + 8 for mma_row_sum's P V.
WGMMA_N = (64, 72, 80, 96, 128, 136, 160, 176, 192, 256)
WGMMA_MAX_N = 256
# The e4m3 wrappers' N values: block_n of Q K^T (E4M3_BLOCK_NS) and head_dim_v of P V.
WGMMA_E4M3_N = (64, 128, 192, 256)
# mma_row_sum: P V runs over one more n8 tile of V, whose columns are all ones, so that tile of
# O holds the row sums of P.
ROW_SUM_COLUMNS = 8

# Registers after setmaxnreg (FlashAttention-3 paper, section 3.1: the producer needs almost
# none). Consumers share the rest of the 64K: 24 + 2 x 240 = 504 per thread-slot of 128 threads
# with two consumer warpgroups, 24 + 3 x 160 = 504 with three.
PRODUCER_REGISTERS = 24
# The paged layout's producer: its 128 threads gather K/V rows with cp.async where pages are 16
# keys (algo/cache_gather.cuh), each thread's page lookups for eight rows of two blocks (the next
# one's prefetched) live beside the tile walk's state: at 56, 64, 72, 80 registers hd128 spilled
# 76, 48, 4, 4 bytes (2026-12-04); 88 + 2 x 208 = 504 (the two consumer warpgroups need about 188
# at hd64/128). At head_dim_v 64 only for now: hd128 gathered measured 0.50-0.60x the varlen
# call at 16-key pages against TMA's 0.42-0.44x, but in builds beside the shipped one (80
# registers gathering every page size, or three stages); its shipped build waits for a GPU run
# (docs/performance.md, entry 163). At 256 the consumers of the paged tile (m128n80) spill
# below 240.
GATHER_PRODUCER_REGISTERS = 88
GATHER_MAX_HEAD_DIM_V = 64
# Registers of a consumer thread beyond S, O and P: softmax state, descriptors, loop state.
# 28: hd64 m192n128 with mma_row_sum (S 64 + O and row sums 36 + P 32 = 132) compiles without
# spills under setmaxnreg 160.
REGISTER_OVERHEAD = 28
MBARRIERS_PER_Q_STAGE = 2  # q_full, q_empty
# e4m3: a V^T tile is chunks of head_dim_v rows of 128 keys (one 128-byte swizzle row each, the
# P V wgmma's K-major B), one TMA box each; block_n is whole wgmma k-steps of 32 keys that are a
# wgmma N. 192 keys take two chunks, the second's last 64 keys unread.
E4M3_KEYS_PER_CHUNK = SWIZZLE_ROW_BYTES
E4M3_BLOCK_NS = (128, 192, 256)
# Consumer warpgroups per CTA. One-consumer tiles (two CTAs per SM) measured 35-50 % faster than
# one such CTA per SM but still below the two-consumer tiles (run 23); three consumers keep
# hd64's short MMAs fed (runs 11-20).
CONSUMER_CHOICES = (2, 3)


class Fa3Tile(SoftmaxTricksTile):
    ALGORITHM: ClassVar[str] = "fa3 fwd"

    block_m: int = Field(gt=0, description="query rows per CTA: 64 per consumer warpgroup")
    block_n: int = Field(gt=0, description="key rows per K/V tile")
    warps: int = Field(gt=0, description="warps per CTA: 4 per consumer warpgroup + 4 producer")
    stages: int = Field(gt=0, description="K/V shared-memory ring depth")
    pingpong: bool = Field(False, description="the two consumer warpgroups take turns on the MMAs")
    early_first_qk: bool = Field(
        False, description="a tile's first Q K^T runs under the previous tile's epilogue (two Q "
        "buffers)")
    peel_masked_blocks: bool = Field(
        False, description="the key blocks that may need a mask run in a loop of their own, so "
        "that the main loop carries no mask code")
    mma_row_sum: bool = Field(
        False, description="the softmax row sums come out of P V (V gets a column of ones) "
        "instead of one add per score")

    STRUCTURE: ClassVar[dict[str, Any]] = {
        "warp_specialized": True, "intra_wg_overlap": True, "persistent": True}
    SUFFIXES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("warp_specialized", "ws"), ("pingpong", "pp"), ("intra_wg_overlap", "ov"),
        ("persistent", "ps"), ("early_first_qk", "fq"), ("peel_masked_blocks", "pm"),
        ("mma_row_sum", "ms"), *SoftmaxTricksTile.SUFFIXES)


@dataclass(frozen=True)
class Fa3Geometry(TmaRingLayout):
    pingpong: bool
    early_first_qk: bool
    peel_masked_blocks: bool
    mma_row_sum: bool
    # The paged layout: the producer warpgroup gathers K/V tiles where TMA would copy 16-key boxes.
    gathers_kv: bool = field(default=False, kw_only=True)

    @property
    def consumers(self) -> int:
        return self.block_m // CONSUMER_ROWS

    @property
    def expected_warps(self) -> int:
        return 4 * (self.consumers + 1)

    @property
    def q_stages(self) -> int:
        """early_first_qk issues a tile's first Q K^T before the previous tile's epilogue, so
        that tile's Q must be in shared memory by then: with one Q buffer it is loaded only
        after the previous tile's last Q K^T, and the epilogue waited for it (run 44: -2...-6 %
        at hd64). A second buffer lets the producer load it a whole tile ahead."""
        return 2 if self.early_first_qk else 1

    @property
    def pv_columns(self) -> int:
        """N of the P V wgmma: head_dim_v, plus the column tile of ones with mma_row_sum."""
        return self.head_dim_v + (ROW_SUM_COLUMNS if self.mma_row_sum else 0)

    @property
    def reads_v_transposed(self) -> bool:
        """e4m3: wgmma takes 8-bit B operands K-major only, so P V reads V^T tiles (head_dim_v
        rows of block_n keys, the V tile's bytes), which the kernel's companion wrote
        (algo/v_transpose.cuh)."""
        return self.element_bytes == 1

    @property
    def vt_chunks(self) -> int:
        """e4m3: the 128-key chunks of a V^T tile."""
        return -(-self.block_n // E4M3_KEYS_PER_CHUNK)

    @property
    def smem_v_tile_bytes(self) -> int:
        """A V tile (block_n x head_dim_v), or with e4m3 a V^T tile (vt_chunks x head_dim_v
        rows of 128 keys)."""
        if self.reads_v_transposed:
            return self.vt_chunks * self.head_dim_v * E4M3_KEYS_PER_CHUNK
        return super().smem_v_tile_bytes

    @property
    def chunk_columns(self) -> int:
        """Elements of a 128-byte swizzle row: the TMA box width and the wgmma atom."""
        return SWIZZLE_ROW_BYTES // self.element_bytes

    @property
    def smem_v_stage_bytes(self) -> int:
        """mma_row_sum: each V tile is followed by a 64-column chunk of ones (block_n rows of
        128 bytes, all of them ones so that the swizzle cannot pick a wrong column), which the
        P V wgmma reads as its columns head_dim_v ... head_dim_v + 7: the chunk after V's last
        one, at the same chunk stride."""
        ones_chunk = self.block_n * SWIZZLE_ROW_BYTES if self.mma_row_sum else 0
        return self.smem_v_tile_bytes + ones_chunk

    @property
    def smem_control_bytes(self) -> int:
        """The mbarriers."""
        return 8 * (MBARRIERS_PER_Q_STAGE * self.q_stages + MBARRIERS_PER_STAGE * self.stages)

    @property
    def producer_registers(self) -> int:
        return GATHER_PRODUCER_REGISTERS if self.gathers_kv else PRODUCER_REGISTERS

    @property
    def consumer_registers(self) -> int:
        return consumer_registers(self.threads, self.consumers, self.producer_registers)

    @property
    def estimated_registers(self) -> int:
        """Per consumer thread: O and S accumulators and the P fragments (with the overlap, P of
        block j-1 is live while S of block j accumulates: that is this term)."""
        acc_o = self.pv_columns // 2
        acc_s = self.block_n // 2
        p_fragments = self.block_n * self.element_bytes // 8
        return acc_o + acc_s + p_fragments + REGISTER_OVERHEAD

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.block_m % CONSUMER_ROWS or self.consumers not in CONSUMER_CHOICES:
            out.append(f"tile.block_m={self.block_m}: must be 128 or 192 (two or three consumer "
                       "warpgroups of 64 rows)")
        if self.block_n not in WGMMA_N:
            out.append(f"tile.block_n={self.block_n}: must be a wgmma N in {WGMMA_N}")
        if not out and self.warps != self.expected_warps:
            out.append(
                f"tile.warps={self.warps}: block_m={self.block_m} needs {self.expected_warps} warps "
                f"({self.consumers} consumer warpgroups and the producer)"
            )
        if self.early_first_qk and self.pingpong:
            out.append("tile.early_first_qk: not with pingpong (a consumer issues the next tile's "
                       "first Q K^T on its own, outside the turns)")
        if self.mma_row_sum and self.pv_columns > WGMMA_MAX_N:
            out.append(f"tile.mma_row_sum: P V would need N = {self.pv_columns} > {WGMMA_MAX_N} "
                       f"at {self.head_dims}")
        elif self.mma_row_sum and self.pv_columns not in WGMMA_N:
            out.append(f"tile.mma_row_sum: no wgmma wrapper for N = {self.pv_columns}")
        if self.pingpong and self.consumers != 2:
            out.append("tile.pingpong: needs two consumer warpgroups (block_m=128)")
        if self.reads_v_transposed:
            out.extend(self._e4m3_problems())
        if not (2 <= self.stages <= 4):
            out.append(f"tile.stages={self.stages}: must be in [2, 4]")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > self.consumer_registers:
            out.append(
                f"tile (block_n={self.block_n}) needs about {self.estimated_registers} registers "
                f"per consumer thread at {self.head_dims}; consumers get "
                f"{self.consumer_registers}"
            )
        return out


    def _e4m3_problems(self) -> list[str]:
        out = []
        for name, dim in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
            if dim % self.chunk_columns:
                out.append(f"{name}={dim}: e4m3 tiles need a multiple of {self.chunk_columns} (a "
                           "128-byte swizzle row of one-byte elements; 64 would need the 64-byte "
                           "swizzle, not built)")
        if self.block_n not in E4M3_BLOCK_NS:
            out.append(f"tile.block_n={self.block_n}: e4m3 takes {E4M3_BLOCK_NS} (V^T tiles are "
                       f"chunks of {E4M3_KEYS_PER_CHUNK} keys, Q K^T a wgmma N)")
        if self.mma_row_sum:
            out.append("tile.mma_row_sum: not with e4m3 (its row sums would be of P rounded to "
                       "e4m3; the softmax sums it in fp32)")
        return out


def head_dim_problem(head_dim: int) -> str | None:
    """Why no FA3 forward tile can take `head_dim`, or None."""
    if head_dim % TMA_COLUMNS or head_dim not in WGMMA_N:
        return (f"head_dim={head_dim}: the FA3 template needs a multiple of {TMA_COLUMNS} "
                f"(128-byte swizzle atoms) that is a wgmma N in {WGMMA_N}")
    return None


# ---- FA3 forward (wgmma + TMA, sm90a): consumer warpgroups of 64 rows + 1 producer
# warpgroup, the softmax overlapped with the previous P V inside each warpgroup, a
# persistent grid (the kernel's structure, each measured in the ablations listed in
# docs/performance.md), ping-pong where it measured better. The persistent grid hides each
# tile's Q/K load latency behind the previous tile; under the causal mask it walks pairs of
# heavy + light query blocks (algo/tile_scheduler.cuh). Speeds: H200 sweeps of 2026-11-30
# (runs 11-30), ratios to cuDNN in the same run; rows with max_seqlen_k serve calls with at
# most that many keys. ----
# Head dim 64 peels the key blocks that may need a mask out of the main loop
# (peel_masked_blocks): 1.00-1.03x the one-loop kernels at 1k-16k, both masks, in run 54;
# head dims 128 and 256 measured 0.94-1.02x with it (the ping-pong tiles lowest) and keep
# one loop.
# `tile: auto` tries this algorithm's rows (fagen/model/tuning.py) in order, per head-dim bucket.
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=3, early_first_qk=True,
                      peel_masked_blocks=True), 64,
              "non-causal up to 512 keys, where a tile is only 4 key blocks: early_first_qk (the "
              "next tile's first Q K^T runs under this tile's epilogue) with three K/V stages, "
              "so that the next tile's first K has landed by then (with two it loses 5-10 %, "
              "run 47 sweep16): 388 against 369 (three stages without it) and 360 TFLOP/s (the "
              "two-stage row below) in sweep16, 374 against 358 in the bundle (run 48); at 1k "
              "+1 % in the sweep, -3 % in the bundle, so 1k keeps the row below",
              causal=False, max_seqlen_k=512),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2, peel_masked_blocks=True), 64,
              "short non-causal rows: 128-row tiles waste less of the last query block than "
              "192 (1k: 6 x 192 = 1152 rows for 1024) and give 4 CTAs' worth more tiles; 406 vs "
              "384 TFLOP/s (0.94 vs 0.89x cuDNN) at 1k, 429 vs 440 at 2k (run 20, sweep9). "
              "64-row tiles with two CTAs per SM measured below it at 512-4k (338 vs 350 at 512, "
              "run 23, sweep11)", causal=False, max_seqlen_k=1024),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=3, peel_masked_blocks=True), 64,
              "causal up to 512 keys: a third K/V stage (113 KB smem) measured 240/242 against "
              "235/237 TFLOP/s for two stages (+2 %, two repeats, run 30 sweep14; +1 % in the "
              "shipped bundle, run 31) and equal at 1k; why only the shortest rows gain is not "
              "established", causal=True, max_seqlen_k=512),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2, peel_masked_blocks=True), 64,
              "causal up to 4k: 304/370/406 TFLOP/s at 1k/2k/4k (0.91/0.98/0.98x cuDNN) against "
              "252/328/405 for three consumers; ping-pong on the same tile is 8-10% slower now "
              "that the overlap inside a warpgroup works (run 20, sweep9)",
              causal=True, max_seqlen_k=4096),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2, peel_masked_blocks=True), 64,
              "softcap or ALiBi: the three-consumer row below spilled 12-120 bytes at its 160 "
              "registers with the modifier's (2026-12-02); two consumers have 240",
              score=("softcap", "alibi")),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=3, peel_masked_blocks=True), 64,
              "the paged layout (a KV-cache prefill): the three-consumer row below spilled 12 "
              "bytes at its 160 registers with the cache's row state and the V rows' clearing "
              "(2026-12-02); two consumers have 208 beside the gathering producer. A third stage "
              "(112 KB smem): 377-435 against 329-383 TFLOP/s at 256-key pages (TMA), the same "
              "at 16 (gathered) (2026-12-04; at hd128 a third stage lost 30 % gathering 16-key "
              "pages and changed the TMA rows by under 3 %)", layout="paged"),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2), 64,
              "a custom mask: the three-consumer row below spilled 4 bytes with the document "
              "mask's element mask on every block (2026-12-02); two consumers have 240",
              mask="custom"),
    TuningRow(Fa3Tile(block_m=192, block_n=128, warps=16, stages=2, peel_masked_blocks=True,
                      mma_row_sum=True), 64,
              "three consumer warpgroups (setmaxnreg 160 each: S 64 + O 32 (+4) + P 32 regs) "
              "keep 12 consumer warps per SM busy where hd64's short MMAs leave 8 waiting on "
              "softmax; persistent. Run 20 (sweep9): non-causal 440/458/485 TFLOP/s at 2k/4k/8k "
              "(0.98/1.00/1.07x cuDNN) against 429/449/452 for m128n128; causal 8k 449 against "
              "431. The row sums come out of P V (mma_row_sum: 386 instead of 448 main-loop "
              "instructions): +1...+5 % at 2k-16k non-causal, 0...+3 % causal 8k-16k (runs 57, "
              "58); on the two-consumer rows above it measured -5...+1 % (idle MUFU time, not "
              "issue slots, is what those lose: run 58). 121 KB smem"),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2), 128,
              "any score modifier: the non-causal ping-pong tile of 160 keys below spilled 84 "
              "bytes with the softcap's registers (2026-12-02); the causal row's tile",
              score=("softcap", "alibi", "sinks")),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2, pingpong=True), 128,
              "short non-causal rows: 1k is 6.4 blocks of 160 keys (the last one 40% used) but 8 "
              "of 128; 519 vs 493 TFLOP/s (0.92 vs 0.88x cuDNN) at 1k, 573 vs 582 at 2k (run 20, "
              "sweep9); 161 KB smem", causal=False, max_seqlen_k=1024),
    TuningRow(Fa3Tile(block_m=128, block_n=160, warps=12, stages=2, pingpong=True), 128,
              "non-causal: persistent, ping-pong; 582/609/626 TFLOP/s at 2k/4k/8k (0.99/1.02/"
              "1.03x cuDNN) against 558/575/611 without ping-pong and 539/582/616 for block_n 176 "
              "non-persistent (which spills 12 bytes when persistent) in run 20 (sweep9); S 80 + "
              "O 64 + P 40 regs fit the 240 of a consumer; 193 KB smem", causal=False),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2), 128,
              "causal: persistent pairs without ping-pong: 397/485/545/577 TFLOP/s at 1k-8k "
              "(0.94/1.00/1.04/1.06x cuDNN) against 377/459/519/549 with it, 5% slower since the "
              "softmax overlaps the warpgroup's own P V (run 20, sweep9); block_n 160 wastes more "
              "of each diagonal block (437 at 2k); 161 KB smem (Q 32 KB + 2 stages x K,V 32 KB)",
              causal=True),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2, pingpong=True), 192,
              "head_dim 192 with head_dim_v 128 (DeepSeek-V3 prefill), non-causal: head_dim "
              "128's causal tile with ping-pong, as its non-causal rows take; 160 keys would "
              "need 248 KB smem (K rows are 384 bytes). O 64 + S 64 + P 32 regs per consumer; "
              "208 KB smem", causal=False, head_dim_v=128),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=2), 192,
              "head_dim 192 with head_dim_v 128, causal: head_dim 128's causal tile (no "
              "ping-pong, as there); 208 KB smem", causal=True, head_dim_v=128),
    TuningRow(Fa3Tile(block_m=128, block_n=80, warps=12, stages=2), 256,
              "any score modifier: the causal row's tile, without the non-causal row's ping-pong "
              "(whose causal mask code alone spilled 4 bytes)", score=("softcap", "alibi", "sinks")),
    TuningRow(Fa3Tile(block_m=128, block_n=80, warps=12, stages=2, pingpong=True), 256,
              "non-causal: O alone is 128 regs per consumer thread at head_dim 256, so block_n 80 "
              "(S 40 + P 20 regs) is the widest block that fits 240; it beat block_n 64 by 5-7% "
              "(629 vs 588 TFLOP/s at 4k, run 6). Persistent with ping-pong: 549/619/666/698 "
              "TFLOP/s at 1k-8k (0.91/0.98/1.00/1.05x cuDNN) against 529/586/651/679 for the "
              "one-tile kernel without it (run 20, sweep9); 225 KB smem", causal=False),
    TuningRow(Fa3Tile(block_m=128, block_n=64, warps=12, stages=2), 256,
              "causal up to 512 keys: a 512-key row is 8 blocks of 64 (the diagonal ones wasting "
              "less) against 6.4 of 80; 274/269 TFLOP/s against 259/260 for block_n 80 (runs 22 "
              "and 23, sweep10/11; equal at 1k); 193 KB smem", causal=True, max_seqlen_k=512),
    TuningRow(Fa3Tile(block_m=128, block_n=80, warps=12, stages=2), 256,
              "causal: block_n 80 as above; persistent pairs 392/504/588/642 TFLOP/s at 1k-8k "
              "(0.88/0.96/1.04/1.08x cuDNN) against 373/469/542/603 for the one-tile kernel "
              "(run 20, sweep9). No ping-pong: with it the causal mask code spills 4 bytes",
              causal=True),
    # ---- e4m3 (FP8): each stage holds K and V^T (E4M3_BLOCK_NS).
    TuningRow(Fa3Tile(block_m=128, block_n=192, warps=12, stages=2), 128,
              "e4m3: S 96 + O 64 + P 24 regs per consumer; 192 keys a block (V^T in two "
              "128-key chunks, the second's last 64 keys unread) against 128: 802/851/826 "
              "against 735/813/830 TFLOP/s non-causal at 4k/8k/16k, causal 727/810/807 against "
              "704/769/798; a third stage the same, block_n 256 needs 252 registers (2026-12-04); "
              "ping-pong 467-532 against 596-627 at block_n 128 (before V^T came from the "
              "companion); 129 KB smem",
              dtypes=("e4m3",)),
    TuningRow(Fa3Tile(block_m=128, block_n=128, warps=12, stages=3), 256,
              "e4m3: O alone is 128 regs per consumer (S 64 + P 16 beside it, of the 240 two "
              "consumers get); 225 KB smem (Q 32 KB + 3 stages x K, V^T 32 KB each); two stages "
              "measured 1034 against 1116 TFLOP/s causal at 16k, the same elsewhere (2026-12-04)",
              dtypes=("e4m3",)),
)


class Fa3ForwardSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(value_dim_rule(
        head_dim_problem, "the tuning rows choose a tile by head_dim, whose O must fit the "
        "consumers' registers"))
    MASKS: ClassVar[tuple[str, ...]] = contract.MASK_KINDS
    # paged: a KV-cache call's prefill (many query rows), its K/V tiles gathered through the block
    # table in runs of keys (contract.cache_box_rows); decode goes to the split-KV kernels.
    LAYOUTS: ClassVar[tuple[str, ...]] = ("dense", "varlen", "paged")
    DTYPES: ClassVar[tuple[str, ...]] = contract.DTYPES
    FA_VERSION: ClassVar[int] = 3
    DIRECTION: ClassVar[str] = "fwd"
    TEMPLATE: ClassVar[str] = "fa3_fwd_sm90.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = (Arch.sm90a,)
    WHY_ARCHS: ClassVar[str] = "wgmma and setmaxnreg exist only on sm_90a"
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HGMMA", "UTMALDG", "SYNCS")

    fa_version: Literal[3]
    direction: Literal["fwd"] = "fwd"
    tile: Fa3Tile

    @model_validator(mode="after")
    def _check_softmax_options(self) -> "Fa3ForwardSpec":
        """FA3 takes exp2_emulation only (its tile is a SoftmaxTricksTile)."""
        if self.tile.rescale_threshold is not None:
            raise ValueError("tile.rescale_threshold: not built for FA3 (e4m3's P, scaled to use its range, "
                             "would pass 448 when the reference maximum lags)")
        return self

    @model_validator(mode="after")
    def _check_e4m3_variant(self) -> "Fa3ForwardSpec":
        if self.dtype == "e4m3" and (problem := self.e4m3_variant_problem()):
            raise ValueError(problem)
        return self

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa3Tile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa3Geometry:
        return Fa3Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                           tile.pingpong, tile.early_first_qk, tile.peel_masked_blocks,
                           tile.mma_row_sum, head_dim_v=head_dim_v,
                           element_bytes=contract.DTYPE_BYTES[dtype])

    @property
    def geometry(self) -> Fa3Geometry:
        """geometry_of, with the paged layout's gathering producer (its registers)."""
        geometry = super().geometry
        return replace(geometry, gathers_kv=self.layout == "paged" and geometry.head_dim_v <= GATHER_MAX_HEAD_DIM_V)

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", g.block_m),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kThreads", g.threads),
            Constexpr("kStages", g.stages),
            Constexpr("kQStages", g.q_stages),
            Constexpr("kPingpong", g.pingpong),
            Constexpr("kEarlyFirstQk", g.early_first_qk),
            Constexpr("kPeelMaskedBlocks", g.peel_masked_blocks),
            Constexpr("kMmaRowSum", g.mma_row_sum),
            Constexpr("kPVColumns", g.pv_columns),
            Constexpr("kSmemVStageBytes", g.smem_v_stage_bytes),
            Constexpr("kProducerRegisters", g.producer_registers),
            Constexpr("kConsumerRegisters", g.consumer_registers),
            Constexpr("kSmemQOffset", g.smem_q_offset),
            Constexpr("kSmemKOffset", g.smem_k_offset),
            Constexpr("kSmemVOffset", g.smem_v_offset),
            Constexpr("kSmemBarrierOffset", g.smem_barrier_offset),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kGathersKv", g.gathers_kv),
            *paged_constexprs(self.layout),
            *self.tile.softmax_constexprs(),
            *v_transpose_constexprs(g.head_dim_v),
            Constexpr("kVtChunks", g.vt_chunks if g.reads_v_transposed else 0),
        ]

    @property
    def required_sass(self) -> tuple[str, ...]:
        """e4m3's wgmma is QGMMA in SASS (HGMMA: the 16-bit one)."""
        if self.dtype == "e4m3":
            return tuple("QGMMA" if family == "HGMMA" else family for family in self.REQUIRED_SASS)
        return self.REQUIRED_SASS

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=g.block_m, dynamic_smem=g.smem_bytes,
                               grid="persistent", tma_q_rows=g.block_m, tma_kv_rows=g.block_n)
