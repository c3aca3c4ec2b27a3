"""FA2 split-KV forward over a KV cache (mma.sync, sm80+): the paged layout's kernels.

Decoding reads every cached key and value once per new token, so its time is the memory's, not
the tensor cores': one query row per 128-row tile and one CTA per (batch row, head) read K/V at
0.30-0.36x the peers' GB/s on the H200 (2026-12-01). This kernel is built for the read instead
(templates/include/fagen/fa2/split_kv.cuh):

- GQA packing: the query rows of one K/V head (seqlen_q tokens x the heads_q / heads_kv query
  heads it serves) share a 16-row mma.sync tile, so one read of a K/V row serves all of them;
- warp-split keys: every warp of the CTA takes every `warps`-th block of block_n keys and keeps
  its own ring of `stages` K/V slots in shared memory (no CTA barrier in the loop), and the warps'
  partial softmax states merge once at the end;
- split-KV: num_splits CTAs share the keys of one (batch row, K/V head, query block) when the
  grid would not fill the GPU otherwise (contract.split_count), and the combine entry point
  merges their normalised partial results;
- the cache: each batch row's length at run time (seqused_k), its keys contiguous or in pages
  through a block table (looked up per 16 keys, which never cross a page: page sizes are
  multiples of 16), its queries dense or packed (cu_seqlens_q).

The mask is a band (mask: local, structure): full and causal are bands whose edges the host
sets (contract.banded), so one kernel serves the three.

An e4m3 cache (kv_dtype: e4m3, under fp16 / bf16 queries) halves the bytes a decode reads; its
rows land in shared memory as they are and widen to fp16 in registers, exactly, by moving bits
(no conversion instruction: sm80 reads it too); the products run in fp16 whatever the queries'
type (bf16 queries scaled into fp16 by a power of two per CTA). The widening pairs the columns of a
lane's ldmatrix (split_kv.cuh says how), which asks for head dims that are multiples of 32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field

from .. import contract
from .arch import ARCHS, MAX_REGISTERS_PER_THREAD, Arch
from .base import Constexpr, KernelSpec, TileBase
from .fa2 import MMA_M, WARP_CHOICES, head_dim_problem, row_pitch_bytes
from .layout import ELEMENT_BYTES, TileGeometry, smem_limit_problems
from .tuning import TuningRow

# Packed query rows per CTA: one m16 tile, which every warp multiplies by its own keys.
BLOCK_M = MMA_M
# Keys per block-table lookup: the page-size multiple (vLLM's pages are 16 keys); a warp's
# step of block_n keys looks up block_n / LOOKUP_ROWS pages.
LOOKUP_ROWS = contract.PAGE_SIZE_MULTIPLE
BLOCK_N_CHOICES = (16, 32)
STAGE_RANGE = (2, 8)
FP32_BYTES = 4
# Registers beyond the O and S accumulators: addresses, the row state of two rows, the ring's
# indices (FA2's forward measures 40-60).
REGISTER_OVERHEAD = 48
# A split is worth its partial writes and the combine's reads from this many steps per warp on:
# below it, the ring's first loads are most of a CTA's time.
MIN_SPLIT_STEPS_PER_WARP = 4
# The launch bound's CTAs per SM: as many as shared memory lets an SM hold, at most this. Without
# it ptxas may cap a 128-thread kernel at 128 registers, as if four CTAs could share an SM, and
# spill (sm80, head dim 128, an e4m3 cache: 4 bytes at 128 registers).
MAX_BOUND_CTAS_PER_SM = 2
# An e4m3 cache's ldmatrix.x4 takes two 16-column chunks of a row (split_kv.cuh).
E4M3_CACHE_HEAD_DIM_MULTIPLE = 32


class Fa2SplitKvTile(TileBase):
    ALGORITHM: ClassVar[str] = "fa2 fwd paged"

    # Always in the canonical dump (it was the kernels' structure, 16, before it was a field).
    block_n: int = Field(16, description="keys per warp step (16 or 32), looked up in runs of 16: "
                         "any page size that is a multiple of 16 serves")
    warps: int = Field(gt=0, description="warps per CTA, each with its own keys and ring")
    stages: int = Field(gt=0, description="K/V slots in each warp's ring (loads in flight: "
                        "stages - 1)")

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def sizes(self) -> str:
        return f"m{BLOCK_M}n{self.block_n}w{self.warps}s{self.stages}"


@dataclass(frozen=True)
class Fa2SplitKvGeometry(TileGeometry):
    cache_element_bytes: int = field(default=ELEMENT_BYTES, kw_only=True)  # k's and v's

    @property
    def q_row_pitch_bytes(self) -> int:
        """Q rows (FA2's padded pitch: ldmatrix and cp.async conflict-free)."""
        return row_pitch_bytes(self.head_dim, self.element_bytes)

    @property
    def row_pitch_bytes(self) -> int:
        """K rows, of the cache's element."""
        return row_pitch_bytes(self.head_dim, self.cache_element_bytes)

    @property
    def v_row_pitch_bytes(self) -> int:
        return row_pitch_bytes(self.head_dim_v, self.cache_element_bytes)

    @property
    def q_maxima_offset(self) -> int:
        """Where an e4m3 cache's kernel meets its warps' largest |q| (after the Q rows)."""
        return BLOCK_M * self.q_row_pitch_bytes

    @property
    def smem_q_bytes(self) -> int:
        """The Q rows, and with an e4m3 cache a float per warp, padded to 16 bytes."""
        maxima = -(-self.warps * FP32_BYTES // 16) * 16 if self.cache_element_bytes == 1 else 0
        return self.q_maxima_offset + maxima

    @property
    def smem_warp_stage_bytes(self) -> int:
        """One slot of a warp's ring: block_n K rows, then block_n V rows."""
        return self.block_n * (self.row_pitch_bytes + self.v_row_pitch_bytes)

    @property
    def smem_ring_bytes(self) -> int:
        return self.warps * self.stages * self.smem_warp_stage_bytes

    @property
    def smem_merge_bytes(self) -> int:
        """The warps' partial results at the end, over the rings: each warp's O rows (fp32), then
        three floats per row and warp (the scaled maximum, the sum, the operand rounding)."""
        return self.warps * BLOCK_M * (self.head_dim_v + 3) * FP32_BYTES

    @property
    def smem_bytes(self) -> int:
        return self.smem_q_bytes + max(self.smem_ring_bytes, self.smem_merge_bytes)

    @property
    def accumulator_registers(self) -> int:
        """fp32 registers per thread for a warp's O and S accumulators (16 rows each)."""
        return BLOCK_M * (self.head_dim_v + self.block_n) // 32

    @property
    def estimated_registers(self) -> int:
        return self.accumulator_registers + REGISTER_OVERHEAD

    @property
    def min_split_keys(self) -> int:
        return MIN_SPLIT_STEPS_PER_WARP * self.warps * self.block_n

    def problems(self, max_smem: int) -> list[str]:
        out: list[str] = []
        if problem := head_dim_problem(self.head_dim):
            out.append(problem)
        if self.block_n not in BLOCK_N_CHOICES:
            out.append(f"tile.block_n={self.block_n}: must be one of {BLOCK_N_CHOICES}")
        if self.warps not in WARP_CHOICES:
            out.append(f"tile.warps={self.warps}: must be one of {WARP_CHOICES}")
        if not (STAGE_RANGE[0] <= self.stages <= STAGE_RANGE[1]):
            out.append(f"tile.stages={self.stages}: must be in [{STAGE_RANGE[0]}, {STAGE_RANGE[1]}]")
        if self.cache_element_bytes == 1 and (self.head_dim % E4M3_CACHE_HEAD_DIM_MULTIPLE
                                              or self.head_dim_v % E4M3_CACHE_HEAD_DIM_MULTIPLE):
            out.append(f"{self.head_dims}: an e4m3 cache takes head dims that are multiples of "
                       f"{E4M3_CACHE_HEAD_DIM_MULTIPLE}")
        if out:
            return out
        out.extend(smem_limit_problems(self, max_smem))
        if self.estimated_registers > MAX_REGISTERS_PER_THREAD:
            out.append(f"tile.block_n={self.block_n} needs about {self.estimated_registers} registers "
                       f"per thread at {self.head_dims}; the limit is {MAX_REGISTERS_PER_THREAD}")
        return out


def split_kv_value_dim_rule(head_dim: int, head_dim_v: int) -> str | None:
    if problem := head_dim_problem(head_dim_v):
        return problem
    return None


E4M3_CACHE = ("fp16-e4m3", "bf16-e4m3")  # the rows' dtypes (contract.dtypes_name)

# Tiles: a stream of K/V rows, two CTAs per SM where they fit. From bench.decode --sweep on the
# H200 (2026-12-02; bf16, 32:8 heads, GB/s at batch 1 / 64k keys, 64 / 4k, 64 / 1k): loads in
# flight beyond ~70 KB per SM bought nothing (hd128: 4 stages at one CTA per SM 3035 / 3865 /
# 3115, against 3044 / 3923 / 3282 for its row below).
TUNING: tuple[TuningRow, ...] = (
    TuningRow(Fa2SplitKvTile(warps=4, stages=6), 64,
              "2288 / 3584 / 2711 GB/s, 2 CTAs per SM (110 KB); 4 stages (3 CTAs per SM) "
              "2352 / 3239 / 2476"),
    TuningRow(Fa2SplitKvTile(warps=4, stages=4), 64, "fallback for 99 KB parts (74 KB)"),
    TuningRow(Fa2SplitKvTile(warps=4, stages=3), 128,
              "3044 / 3923 / 3282 GB/s, 2 CTAs per SM (106 KB); 2 warps with 4 stages 2818 / "
              "3816 / 3064"),
    TuningRow(Fa2SplitKvTile(warps=4, stages=2), 128,
              "fallback for 99 KB parts (72 KB)"),
    TuningRow(Fa2SplitKvTile(warps=4, stages=2), 256,
              "3522 / 4092 / 3575 GB/s (140 KB, one CTA per SM; fits sm80's 163 KB); 3 stages "
              "3499 / 4011 / 3479, 2 warps with 4 stages 3411 / 3971 / 3436"),
    TuningRow(Fa2SplitKvTile(warps=2, stages=2), 256,
              "fallback for 99 KB parts (76 KB; sm120 in specs/blackwell.yaml): not measured, the "
              "H200 takes the row above"),
    # An e4m3 cache: a slot holds half the bytes. From bench.decode --sweep on the H200
    # (2026-12-04; bf16 queries, 32:8 heads, K/V tokens per second as GB/s of bf16 at batch 1 /
    # 64k keys, 64 / 4k, 64 / 16k): 32-key steps pay at head dim 128, where half the bytes per
    # key left the per-step work a larger share.
    TuningRow(Fa2SplitKvTile(warps=4, stages=8), 64,
              "2516 / 5059 / 6020 (83 KB, 2 CTAs per SM); 32-key steps with 8 warps and 4 stages "
              "2794 / 4831 / 6025 but 0.79x at batch 64 / 1k keys, with 4 warps 2785 / 5106 / 5582",
              dtypes=E4M3_CACHE),
    TuningRow(Fa2SplitKvTile(block_n=32, warps=4, stages=3), 128,
              "4358 / 6943 / 7825 (112 KB, 2 CTAs per SM); 16-key steps with 5 stages 3859 / 6551 / "
              "7306, 32-key steps with 8 warps 4263 / 6463 / 7785", dtypes=E4M3_CACHE),
    TuningRow(Fa2SplitKvTile(warps=4, stages=5), 128, "fallback for 99 KB parts (94 KB)", dtypes=E4M3_CACHE),
    TuningRow(Fa2SplitKvTile(warps=4, stages=2), 256,
              "5236 / 7575 / 8194 (76 KB, 2 CTAs per SM); 3 stages 4948 / 7505 / 8071, 32-key steps "
              "5555 / 7365 / 8112", dtypes=E4M3_CACHE),
)


class Fa2SplitKvSpec(KernelSpec):
    TUNING_ROWS: ClassVar[tuple[TuningRow, ...]] = TUNING
    HEAD_DIM_RULE: ClassVar[Callable[[int], str | None]] = staticmethod(head_dim_problem)
    HEAD_DIM_V_RULE: ClassVar[Callable[[int, int], str | None]] = staticmethod(split_kv_value_dim_rule)
    MASKS: ClassVar[tuple[str, ...]] = ("local",)
    WHY_MASKS: ClassVar[str] = ("its mask is a band whose edges the call sets: full and causal "
                                "are bands too, so one local kernel serves all three")
    LAYOUTS: ClassVar[tuple[str, ...]] = ("paged",)
    KV_DTYPES: ClassVar[tuple[str, ...]] = ("e4m3",)
    FA_VERSION: ClassVar[int] = 2
    DIRECTION: ClassVar[str] = "fwd"
    TEMPLATE: ClassVar[str] = "fa2_fwd_paged_sm80.cu.j2"
    ARCHS: ClassVar[tuple[Arch, ...]] = (Arch.sm80, Arch.sm86, Arch.sm89, Arch.sm90, Arch.sm100a,
                                         Arch.sm120)
    WHY_ARCHS: ClassVar[str] = ("mma.sync m16n8k16, ldmatrix and cp.async exist from sm80 on; "
                                "Hopper takes the plain sm90 build")
    REQUIRED_SASS: ClassVar[tuple[str, ...]] = ("HMMA", "LDSM", "LDGSTS")

    fa_version: Literal[2]
    direction: Literal["fwd"] = "fwd"
    layout: Literal["paged"]
    mask: Literal["local"] = "local"
    tile: Fa2SplitKvTile

    @staticmethod
    def geometry_of(head_dim: int, tile: Fa2SplitKvTile, head_dim_v: int | None = None, dtype: str = "bf16") -> Fa2SplitKvGeometry:
        q_dtype, kv_dtype = contract.parse_dtypes(dtype)
        return Fa2SplitKvGeometry(head_dim, BLOCK_M, tile.block_n, tile.warps, tile.stages,
                                  head_dim_v=head_dim_v,
                                  element_bytes=contract.DTYPE_BYTES[q_dtype],
                                  cache_element_bytes=contract.DTYPE_BYTES[kv_dtype])

    def algorithm_constexprs(self) -> list[Constexpr]:
        g = self.geometry
        return [
            Constexpr("kBlockM", BLOCK_M),
            Constexpr("kBlockN", g.block_n),
            Constexpr("kLookupRows", LOOKUP_ROWS),
            Constexpr("kWarps", g.warps),
            Constexpr("kThreads", g.threads),
            Constexpr("kMinCtasPerSm", self.bound_ctas_per_sm),
            Constexpr("kStages", g.stages),
            Constexpr("kQRowPitchBytes", g.q_row_pitch_bytes),
            Constexpr("kRowPitchBytes", g.row_pitch_bytes),
            Constexpr("kVRowPitchBytes", g.v_row_pitch_bytes),
            Constexpr("kQMaximaOffset", g.q_maxima_offset),
            Constexpr("kSmemQBytes", g.smem_q_bytes),
            Constexpr("kSmemWarpStageBytes", g.smem_warp_stage_bytes),
            Constexpr("kSmemRingBytes", g.smem_ring_bytes),
            Constexpr("kSmemMergeBytes", g.smem_merge_bytes),
            Constexpr("kSmemBytes", g.smem_bytes),
            Constexpr("kCompanionThreads", contract.COMPANION_THREADS),
            Constexpr("kCompanionRowsPerCta", contract.COMPANION_ROWS_PER_CTA),
        ]

    @property
    def bound_ctas_per_sm(self) -> int:
        """The launch bound's CTAs per SM (MAX_BOUND_CTAS_PER_SM says why); a block's shared
        memory limit stands in for the SM's (1 KB apart)."""
        fit = ARCHS[self.arch].max_smem_per_block // self.geometry.smem_bytes
        return max(1, min(MAX_BOUND_CTAS_PER_SM, fit))

    def launch(self) -> contract.Launch:
        g = self.geometry
        return contract.Launch(threads=g.threads, block_m=BLOCK_M, dynamic_smem=g.smem_bytes,
                               grid="splits", block_n=g.block_n, min_split_keys=g.min_split_keys)

