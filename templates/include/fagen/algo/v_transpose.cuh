// V^T tiles for the 8-bit P V (fa3/forward.cuh with an e4m3 element). wgmma reads 8-bit B
// operands only K-major, but V lands from TMA keys x head_dim_v with the head dim contiguous (the
// layout flash-attn's callers hold): warps of the producer warpgroup copy each V tile into a V^T
// tile of head_dim_v rows of kKeys keys before the consumers' P V reads it (FlashAttention-3 does
// the same transposition in shared memory; this one is fagen's own).
//
// The keys are permuted within every 16 on the way. P's A fragment (ptx/wgmma.cuh, e4m3) gives
// lane 4g+q the columns 4q..4q+3 of each 16, but the S accumulator P is converted from
// (algo/fragment.cuh) holds columns 2q, 2q+1, 8+2q, 9+2q there. Packing those four as they are
// makes P's logical column 4q+i the physical key {2q, 2q+1, 8+2q, 9+2q}[i]; P V is a sum over
// keys, so it is exact when V^T's column 4q+i holds the same physical key. The conversion then
// needs no shuffles (algo/element.cuh: pack_a_fragment for e4m3).
//
// Source: a V tile as TMA writes it with the 128-byte swizzle: head_dim_v / 128 chunks of kKeys
// rows x 128 bytes; 16-byte unit u of row r at unit u ^ (r % 8). Target: head_dim_v rows of 128
// bytes (the keys), the same swizzle, which is what a K-major wgmma descriptor with the 128-byte
// swizzle reads (SBO 1024).
//
// A step moves 512 bytes, 16 keys (group g) x 32 head-dim bytes (units 2p, 2p+1 of a chunk): one
// ldmatrix.x4.trans reads keys 0-7 and 8-15 of each unit as 8x8 matrices of byte pairs, which
// leaves lane 4j+q with the pair (2j, 2j+1) of keys 2q, 2q+1 from one matrix and of keys 8+2q,
// 9+2q from the other: two byte permutes make V^T rows 2j and 2j+1 at logical keys 4q..4q+3,
// the permutation above for free; one stmatrix.x4 writes the four rows' words. Lanes 4j+q with
// j >= 4 swap their two rows between the stored matrices, so that each matrix's 8 rows have 8
// different row % 8 (swizzle units): then neither instruction meets a bank conflict (checked with
// a model of both instructions, 2026-12-04). Offsets are bit fields that do not overlap, so a
// lane computes its own once and a step XORs in (g, p). The first version moved 4 bytes per lane
// and instruction with the swizzle recomputed per round (1250 instructions per tile and warp,
// the FP8 forward at 0.65x the bf16 one); the second (4-byte words, XOR'd offsets, ~540) still
// bounded it: without any transposition the kernel ran 1.35-1.6x faster (2026-12-04).
#pragma once
#include "fagen/ptx/ldmatrix.cuh"
#include "fagen/ptx/stmatrix.cuh"
#include "fagen/types.cuh"

namespace fagen::algo {

// Transposes the V tile at `src` into the V^T tile at `dst` (shared addresses, both 1024-byte
// aligned), by the kWarps warps of the calling threads; `warp` in [0, kWarps).
template <int kKeys, int kColumns, int kWarps>
__device__ __forceinline__ void transpose_v_tile(uint32_t src, uint32_t dst, int warp, int lane) {
    static_assert(kKeys == 128, "V^T rows are one 128-byte swizzle row of keys");
    static_assert(kColumns % 128 == 0, "whole 128-byte chunks of V");
    constexpr uint32_t kChunkBytes = kKeys * 128;      // a 128-column chunk of V; 128 rows of V^T
    constexpr uint32_t kSteps = (kColumns / 128) * 4 * 8;  // (chunk, unit pair p, key group g)
    // ldmatrix: lane 8m+i gives row i of matrix m, keys 8(m%2)+i of the group, unit m/2 of the
    // pair. Bits: group 11-13, the 8 keys 10, key 7-9, swizzled unit 4-6.
    const uint32_t matrix = lane / 8, row = lane % 8;
    const uint32_t src_lane = ((matrix % 2) << 10) | (row << 7) | (((matrix / 2) ^ row) << 4);
    // stmatrix: lane 8m+r gives row r of matrix m, V^T row 16(2p + m/2) + 2r + (m%2 ^ r/4).
    // Bits: unit pair 12-13, unit 11, row 7-10, swizzled key group 4-6.
    const uint32_t swap = row / 4, odd = (matrix % 2) ^ swap;
    const uint32_t dst_lane = ((matrix / 2) << 11) | (row << 8) | (odd << 7) | (((2 * row + odd) % 8) << 4);
    // This lane's byte pair j = lane / 4: V^T row 2j takes the even bytes, 2j + 1 the odd ones;
    // swapped for j >= 4 (see above).
    const uint32_t first = lane / 4 < 4 ? 0x6420 : 0x7531, second = lane / 4 < 4 ? 0x7531 : 0x6420;
#pragma unroll 1  // two steps in flight spilled 4 bytes at head_dim 256 under the warps' 24 registers
    for (uint32_t step = warp; step < kSteps; step += kWarps) {
        const uint32_t g = step % 8, p = (step / 8) % 4, chunk = step / 32;
        uint32_t pairs[4];
        ptx::ldmatrix_x4_trans(pairs, src + chunk * kChunkBytes + (src_lane ^ (g << 11) ^ (p << 5)));
        const uint32_t rows[4] = {__byte_perm(pairs[0], pairs[1], first), __byte_perm(pairs[0], pairs[1], second),
                                  __byte_perm(pairs[2], pairs[3], first), __byte_perm(pairs[2], pairs[3], second)};
        ptx::stmatrix_x4(dst + chunk * kChunkBytes + (dst_lane ^ (p << 12) ^ (g << 4)), rows);
    }
}

}  // namespace fagen::algo
