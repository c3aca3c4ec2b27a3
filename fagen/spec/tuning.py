"""The one tuning table: what `tile: auto` resolves to.

Each row: the head dims it covers, the tile, and why. Within a head-dim bucket the rows are
tried in order and the first that fits the target's shared memory and registers wins, so a
smaller-smem target (sm86/sm89/sm120: 99 KB) falls through to a smaller tile.
"""

from __future__ import annotations

from dataclasses import dataclass

from types import SimpleNamespace

from .algorithms import algorithm_for
from .arch import ARCHS, Arch


@dataclass(frozen=True)
class TuningRow:
    fa_version: int
    max_head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    reason: str
    warp_specialized: bool = False
    pingpong: bool = False
    intra_wg_overlap: bool = False
    persistent: bool = False
    exp2_emulation: float | None = None
    rescale_threshold: float | None = None
    causal: bool | None = None  # None: the row serves both masks

    def tile_fields(self) -> dict:
        fields = {"block_m": self.block_m, "block_n": self.block_n, "warps": self.warps,
                  "stages": self.stages}
        for flag in ("warp_specialized", "pingpong", "intra_wg_overlap", "persistent"):
            if getattr(self, flag):
                fields[flag] = True
        for option in ("exp2_emulation", "rescale_threshold"):
            if getattr(self, option) is not None:
                fields[option] = getattr(self, option)
        return fields


TABLE: tuple[TuningRow, ...] = (
    # ---- FA2 forward (mma.sync). Register counts are ptxas's for sm90, bf16; speeds from the
    # H200 tile sweep of 2026-11-30 (bench/tile_sweep.py, docs/performance.md), seqlen 4k. ----
    TuningRow(2, 64, 128, 64, 4, 2,
              "32 rows per warp: each K/V fragment read from smem feeds 2 MMAs; 1.06x/1.02x "
              "SDPA-FA2 (full/causal), within 1% of block_n 128, which spills on sm80; 55 KB smem"),
    TuningRow(2, 64, 64, 64, 4, 2,
              "fallback for 99 KB parts: 16 rows per warp, 55 KB smem"),
    TuningRow(2, 128, 128, 32, 4, 2,
              "32 rows per warp with block_n 32 keeps O (128) + S (32) under 255 regs (244-253, "
              "no spills on sm80/86/90): 0.94x/0.97x SDPA-FA2 against 0.82x/0.81x for 16 rows "
              "per warp (m128n64w8); head_dim 96 takes it by the same register arithmetic"),
    TuningRow(2, 128, 64, 64, 4, 2,
              "fallback for 99 KB parts: 16 rows per warp, 52 KB smem"),
    TuningRow(2, 256, 128, 64, 8, 1,
              "O alone is 128 regs at 16 rows per warp, so 16 rows and 8 warps. One K and one V "
              "buffer (stages 1) instead of a 2-stage ring: 0.93/0.93x SDPA-FA2 (full/causal) at "
              "2k against 0.90/0.90x (H200 run 13, 2026-11-30); 64x64 with 4 warps (2 CTAs per "
              "SM, SDPA-FA2's own tile) measured 0.90/0.94x; 132 KB smem at head_dim 256, so "
              "sm80 (163 KB) takes this row too (not measured on an A100)"),
    TuningRow(2, 256, 64, 32, 4, 2,
              "fallback for sm80's 163 KB and 99 KB parts: 64x32 tile, 16 rows per warp"),
    # ---- FA3 forward (wgmma + TMA, sm90a): consumer warpgroups of 64 rows + 1 producer
    # warpgroup, warp specialization + intra-warpgroup overlap (+ ping-pong where it measured
    # better), each measured in the ablation of docs/performance.md. Persistent grids (_ps)
    # hide each tile's Q/K load latency behind the previous tile; under the causal mask they
    # walk pairs of heavy + light query blocks (algo/tile_scheduler.cuh). Speeds: H200 sweeps
    # of 2026-11-30 (runs 11, 13 and 15), ratios to cuDNN in the same run. ----
    TuningRow(3, 64, 192, 128, 16, 2,
              "three consumer warpgroups (setmaxnreg 160 each: S 64 + O 32 + P 32 regs) keep 12 "
              "consumer warps per SM busy where hd64's short MMAs leave 8 waiting on softmax; "
              "persistent. Non-causal 0.92/1.00/1.00/1.01x cuDNN at 1k/2k/4k/8k, causal "
              "0.77/0.86/0.97/0.99x, against 0.79/0.94/0.96/0.98x and 0.72/0.82/0.89/0.91x for "
              "the earlier tiles (m192 non-persistent; m128n128 ping-pong non-persistent) in the "
              "same run (run 15). The m128n128 ping-pong tile made persistent is ahead at 1k-2k "
              "causal (0.87/0.90x) but flat at 0.90x from 4k on; 89 KB smem",
              warp_specialized=True, intra_wg_overlap=True, persistent=True),
    TuningRow(3, 128, 128, 160, 12, 2,
              "non-causal: persistent 557/590 TFLOP/s at 2k/4k against 543/579 for the best "
              "non-persistent tile (block_n 176, which spills 12 bytes when persistent); S 80 + "
              "O 64 + P 40 regs fit the 240 of a consumer; 193 KB smem",
              warp_specialized=True, pingpong=True, intra_wg_overlap=True, persistent=True,
              causal=False),
    TuningRow(3, 128, 128, 128, 12, 2,
              "causal: block_n 176 wastes more of each diagonal block (499 vs 508 TFLOP/s); "
              "persistent pairs 0.98/1.01x cuDNN at 2k/4k against 0.89/0.99x; 161 KB smem (Q 32 "
              "KB + 2 stages x K,V 32 KB)",
              warp_specialized=True, pingpong=True, intra_wg_overlap=True, persistent=True),
    TuningRow(3, 256, 128, 80, 12, 2,
              "non-causal: O alone is 128 regs per consumer thread at head_dim 256, so block_n 80 "
              "(S 40 + P 20 regs) is the widest block that fits 240; it beat block_n 64 by 5-7% "
              "(629 vs 588 TFLOP/s at 4k); 225 KB smem. Not persistent: 0.89/0.90x cuDNN at "
              "2k/4k against 0.93/0.97x. No ping-pong: equal speed (631 vs 629)",
              warp_specialized=True, intra_wg_overlap=True, causal=False),
    TuningRow(3, 256, 128, 80, 12, 2,
              "causal: block_n 80 as above; persistent pairs 0.97/1.03x cuDNN at 2k/4k against "
              "0.90/0.95x. No ping-pong: with it the causal mask code spills 12 bytes",
              warp_specialized=True, intra_wg_overlap=True, persistent=True),
    # ---- FA4 forward (tcgen05 + TMEM, sm100a): 128 query rows, 12 role warps. Not yet run on a
    # B200: the numbers below are derived, not measured. In every row rescale_threshold 8 is the
    # FA4 paper's log2(256): probabilities stay <= 256, harmless for fp32 O and l. exp2_emulation
    # 1/4: MUFU does 16 exp2/clk/SM, the FMA pipe 128 ops/clk/SM and the polynomial costs ~7
    # ops, so the pipes would balance near 1/2; the FMA pipe also carries the scale, max, sum
    # and conversions, hence a conservative 1/4 until measured. ----
    TuningRow(4, 64, 128, 128, 12, 4,
              "S x2 + O = 320 TMEM columns (512 allocated); 148 KB smem: 4 stages of 32 KB K+V "
              "hide TMA latency behind two blocks of MMA",
              exp2_emulation=0.25, rescale_threshold=8.0),
    TuningRow(4, 128, 128, 128, 12, 3,
              "FA4 paper's 128x128 tile: S x2 + O = 384 TMEM columns; Q 32 KB + 3 stages x 64 KB "
              "K+V = 227 KB minus 320 bytes: the deepest ring that fits",
              exp2_emulation=0.25, rescale_threshold=8.0),
    TuningRow(4, 256, 128, 64, 12, 2,
              "block_n 128 would need 2 x 128 + 256 = 512 TMEM columns and 2 stages of 128 KB; "
              "block_n 64: 384 columns, 199 KB smem at head_dim 256",
              exp2_emulation=0.25, rescale_threshold=8.0),
)


def resolve_tile(fa_version: int, arch: Arch, head_dim: int, causal: bool = False) -> TuningRow:
    """The first row of this algorithm's head-dim bucket that fits `arch` and the mask.

    Raises ValueError naming every row tried and why it was rejected.
    """
    rows = [r for r in TABLE if r.fa_version == fa_version and head_dim <= r.max_head_dim
            and r.causal in (None, causal)]
    if not rows:
        raise ValueError(
            f"tile: auto has no entry for fa_version={fa_version} at head_dim={head_dim}; "
            "give the tile explicitly"
        )
    bucket = min(r.max_head_dim for r in rows)
    max_smem = ARCHS[arch].max_smem_per_block
    tried: list[str] = []
    for row in (r for r in rows if r.max_head_dim == bucket):
        tile = SimpleNamespace(**{"warp_specialized": False, "pingpong": False,
                                  "intra_wg_overlap": False, "persistent": False,
                                  **row.tile_fields()})
        geometry = algorithm_for(fa_version, "fwd").geometry(head_dim, tile)
        problems = geometry.problems(max_smem)
        if not problems:
            return row
        tried.append(f"m{row.block_m}n{row.block_n}w{row.warps}s{row.stages}: {'; '.join(problems)}")
    raise ValueError(
        f"tile: auto found no fitting tile for fa_version={fa_version}, arch={arch.value}, "
        f"head_dim={head_dim}: " + " | ".join(tried)
    )
