"""The one tuning table: what `tile: auto` resolves to.

Each row: the algorithm's tile (an instance of its tile model), the head dims it covers, and
why. Within a head-dim bucket of an algorithm the rows are tried in order and the first that
fits the target's shared memory and registers wins, so a smaller-smem target (sm86/sm89/sm120:
99 KB) falls through to a smaller tile.

A row may carry `max_seqlen_k`: the tile that measured best for calls with at most that many
keys. `tile: auto` then yields one kernel per bound of the bucket (plus the unbounded one), and
the runtime picks among a key's kernels by the call's seqlen_k (fagen.runtime.loader.select):
the smallest bound that covers it, else the unbounded kernel. Bounds choose between correct
kernels; they never make a call fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arch import ARCHS, Arch
from .base import TileBase
from .fa1 import Fa1Tile
from .fa2 import Fa2Tile
from .fa2_bwd import Fa2BwdTile
from .fa3 import Fa3Tile
from .fa3_bwd import Fa3BwdTile
from .fa4 import Fa4Tile

if TYPE_CHECKING:
    from .base import KernelSpec


@dataclass(frozen=True)
class TuningRow:
    tile: TileBase
    max_head_dim: int
    reason: str
    # True: the row serves the masks with a diagonal (causal, local), False: the full mask;
    # None: every mask. A window takes the causal rows (like FA3's tile_size.h, whose local and
    # causal tiles are one), not their short-sequence bounds: windows are for long rows.
    causal: bool | None = None
    max_seqlen_k: int | None = None  # None: any seqlen_k not covered by a bounded row


TABLE: tuple[TuningRow, ...] = (
    # ---- FA1 forward (mma.sync; the lineage bundle only). FA1 is the baseline the lineage
    # benchmark measures FA2 and FA3 against, so its tiles are plain, not tuned: 16 rows per warp
    # (the inner loop visits every query block of a head), 4 warps, and the widest key block
    # whose K and V tiles, with two Q buffers, fit 99 KB parts too where the arithmetic allows.
    # Register and shared-memory counts are the geometry's (fagen/spec/fa1.py). ----
    TuningRow(Fa1Tile(block_m=64, block_n=128, warps=4), 64,
              "64 x 128 tile: S 64 + O 32 regs per thread; Q 2 x 9 KB + K, V 2 x 18 KB = 54 KB"),
    TuningRow(Fa1Tile(block_m=64, block_n=128, warps=4), 128,
              "S 64 + O 64 regs; Q 2 x 17 KB + K, V 2 x 34 KB = 102 KB (sm80, sm90)"),
    TuningRow(Fa1Tile(block_m=64, block_n=64, warps=4), 128,
              "fallback for 99 KB parts: K, V 2 x 17 KB, 68 KB in all"),
    TuningRow(Fa1Tile(block_m=64, block_n=64, warps=4), 256,
              "O alone is 128 regs per thread at head_dim 256, so block_n 64 (S 32); Q 2 x 33 KB "
              "+ K, V 2 x 33 KB = 132 KB (sm80, sm90)"),
    TuningRow(Fa1Tile(block_m=64, block_n=32, warps=4), 256,
              "fallback for 99 KB parts: 99 KB"),
    # ---- FA2 forward (mma.sync). Register counts are ptxas's for sm90, bf16; speeds from the
    # H200 tile sweep of 2026-11-30 (bench/tile_sweep.py, docs/performance.md), seqlen 4k. ----
    TuningRow(Fa2Tile(block_m=128, block_n=64, warps=4, stages=2), 64,
              "32 rows per warp: each K/V fragment read from smem feeds 2 MMAs; 1.06x/1.02x "
              "SDPA-FA2 (full/causal), within 1% of block_n 128, which spills on sm80; 55 KB smem"),
    TuningRow(Fa2Tile(block_m=64, block_n=64, warps=4, stages=2), 64,
              "fallback for 99 KB parts: 16 rows per warp, 55 KB smem"),
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
    # ---- FA2 backward (mma.sync): one CTA per key block keeps dK, dV in registers and walks
    # the query blocks. Shared memory's bandwidth runs out first (Nsight Compute, run 99: L1 75 %
    # busy, the warps' main stall the ldmatrix results), so the warps hold 32 keys (S^T, dK,
    # dV) and 32 query rows (dQ) where the registers allow: each operand fragment read from
    # shared memory feeds two MMAs' worth of rows, 20 % fewer bytes per step than one-tile
    # warps, at the price of P^T through shared memory. Register and shared-memory counts are
    # the geometry's (fagen/spec/fa2_bwd.py) and ptxas's (sm90, bf16); speeds from the H200
    # sweep of run 100 (bench.tile_sweep, bf16, 4k / 8k; 2026-12-01) against SDPA-FA2's backward
    # in the same run. sm80 rows are the sm90 tiles with one Q / dO stage (163 KB), measured
    # on the H200 (run 101), not on an A100. ----
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
    # ---- FA3 backward (wgmma + TMA, sm90a): one CTA per key block, two consumer warpgroups that
    # split its keys (head dims 64, 128: 64 keys each, dK and dV in registers) or its columns
    # (head dim 256), a producer warpgroup, steps of 64 queries (the kernel's structure,
    # fagen/spec/fa3_bwd.py). Speeds: H200 (2026-12-01), 2k / 8k. ----
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
    # ---- FA4 forward (tcgen05 + TMEM, sm100a): 128 query rows, 12 role warps. Not yet run on a
    # B200: the numbers below are derived, not measured. In every row rescale_threshold 8 is the
    # FA4 paper's log2(256): probabilities stay <= 256, harmless for fp32 O and l. exp2_emulation
    # 1/4: MUFU does 16 exp2/clk/SM, the FMA pipe 128 ops/clk/SM and the polynomial costs ~7
    # ops, so the pipes would balance near 1/2; the FMA pipe also carries the scale, max, sum
    # and conversions, hence a conservative 1/4 until measured. ----
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
)


def _bucket_rows(algorithm: type[KernelSpec], head_dim: int, mask: str) -> list[TuningRow]:
    tile_model = algorithm.model_fields["tile"].annotation
    rows = [r for r in TABLE if type(r.tile) is tile_model and head_dim <= r.max_head_dim
            and r.causal in (None, mask != "full")
            and not (mask == "local" and r.max_seqlen_k is not None)]
    if not rows:
        raise ValueError(
            f"tile: auto has no entry for fa_version={algorithm.FA_VERSION} "
            f"{algorithm.DIRECTION} at head_dim={head_dim}; give the tile explicitly"
        )
    bucket = min(r.max_head_dim for r in rows)
    return [r for r in rows if r.max_head_dim == bucket]


def _serving_bound(bounds: set[int | None], max_seqlen_k: int | None) -> int | None:
    """The bound whose rows serve calls of up to `max_seqlen_k` keys: the smallest bound that
    covers it, else None (the unbounded rows). The runtime applies the same rule to kernels."""
    if max_seqlen_k is None:
        return None
    covering = [b for b in bounds if b is not None and b >= max_seqlen_k]
    return min(covering) if covering else None


def resolve_tile(algorithm: type[KernelSpec], arch: Arch, head_dim: int, mask: str = "full",
                 max_seqlen_k: int | None = None) -> TileBase:
    """The tile of the first row of `algorithm`'s head-dim bucket that fits `arch` and the
    mask, among the rows that serve calls of up to `max_seqlen_k` keys (None: the unbounded
    rows).

    Raises ValueError naming every row tried and why it was rejected.
    """
    rows = _bucket_rows(algorithm, head_dim, mask)
    bound = _serving_bound({r.max_seqlen_k for r in rows}, max_seqlen_k)
    tried: list[str] = []
    for row in (r for r in rows if r.max_seqlen_k == bound):
        problems = algorithm.geometry_of(head_dim, row.tile).problems(ARCHS[arch].max_smem_per_block)
        if not problems:
            return row.tile
        tried.append(f"{row.tile.sizes}: {'; '.join(problems)}")
    raise ValueError(
        f"tile: auto found no fitting tile for fa_version={algorithm.FA_VERSION}, "
        f"arch={arch.value}, head_dim={head_dim}: " + " | ".join(tried)
    )


def seqlen_bounds(algorithm: type[KernelSpec], arch: Arch, head_dim: int,
                  mask: str = "full") -> list[int]:
    """The seqlen_k bounds `tile: auto` builds extra kernels for on this target, ascending:
    those with a fitting row whose tile differs from the unbounded choice."""
    rows = _bucket_rows(algorithm, head_dim, mask)
    general = resolve_tile(algorithm, arch, head_dim, mask)
    bounds = []
    for bound in sorted({r.max_seqlen_k for r in rows} - {None}):
        try:
            tile = resolve_tile(algorithm, arch, head_dim, mask, bound)
        except ValueError:
            continue  # no row of this bound fits the target
        if tile != general:
            bounds.append(bound)
    return bounds
