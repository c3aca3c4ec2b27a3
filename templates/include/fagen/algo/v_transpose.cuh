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
// rows x 128 bytes; 16-byte unit u of row r at unit u ^ (r % 8). Target: kKeys / 128 chunks of
// head_dim_v rows x 128 bytes (the keys), the same swizzle, which is what a K-major wgmma
// descriptor with the 128-byte swizzle reads (SBO 1024).
//
// Work split, chosen so that neither the loads nor the stores of a warp meet a bank conflict: a
// warp instruction covers 8 groups of 16 keys x 4 lanes each; lane 4j+q reads the 4-byte column
// 32k+4j of group j^m's keys {2q, 2q+1, 8+2q, 9+2q} (4 LDS.32), transposes the 4 x 4 bytes with 8
// byte permutes, and stores head-dim rows 32k+4j .. +3, each 4 consecutive logical keys (4
// STS.32). Over an instruction the 32 loads hit 32 distinct banks (units (2k%8 + j/4) ^ 2q and
// words j%4 differ) and so do the stores (units (j^m) ^ (4(j%2) + c) over j are a permutation).
// Warp w takes m = w, w + kWarps, ... and every k of them. Every offset is a sum of
// bit fields that do not overlap (group, row, 16-byte unit, word), so a lane computes its own
// once and each (m, k, row) only XORs constants in: the first version recomputed the swizzle per
// round (114 instructions a round, 1250 per tile and warp) and held the FP8 forward to 0.65x
// the bf16 one (2026-12-04).
#pragma once
#include "fagen/types.cuh"

namespace fagen::algo {

// Bytes b of w0, w1, w2, w3 as one word (lowest byte from w0), for b = 0..3.
struct TransposedWords {
    uint32_t b0, b1, b2, b3;
};

__device__ __forceinline__ TransposedWords transpose_4x4_bytes(uint32_t w0, uint32_t w1, uint32_t w2,
                                                               uint32_t w3) {
    const uint32_t low01 = __byte_perm(w0, w1, 0x5140);   // w0.b0 w1.b0 w0.b1 w1.b1
    const uint32_t high01 = __byte_perm(w0, w1, 0x7362);  // w0.b2 w1.b2 w0.b3 w1.b3
    const uint32_t low23 = __byte_perm(w2, w3, 0x5140);
    const uint32_t high23 = __byte_perm(w2, w3, 0x7362);
    return {__byte_perm(low01, low23, 0x5410), __byte_perm(low01, low23, 0x7632),
            __byte_perm(high01, high23, 0x5410), __byte_perm(high01, high23, 0x7632)};
}

__device__ __forceinline__ uint32_t load_shared_word(uint32_t address) {
    return *static_cast<const uint32_t*>(__cvta_shared_to_generic(address));
}

__device__ __forceinline__ void store_shared_word(uint32_t address, uint32_t value) {
    *static_cast<uint32_t*>(__cvta_shared_to_generic(address)) = value;
}

// Transposes the V tile at `src` into the V^T tile at `dst` (shared addresses, both 1024-byte
// aligned), by the kWarps warps of the calling threads; `warp` in [0, kWarps).
template <int kKeys, int kColumns, int kWarps>
__device__ __forceinline__ void transpose_v_tile(uint32_t src, uint32_t dst, int warp, int lane) {
    static_assert(kKeys == 128, "V^T rows are one 128-byte swizzle row of keys");
    static_assert(kColumns % 128 == 0, "whole 128-byte chunks of V");
    constexpr uint32_t kRowBytes = 128, kChunkBytes = kKeys * kRowBytes;
    const uint32_t q = lane % 4, j = lane / 4;
    // Source offsets (bits): group 16 keys (11-13), key row in the group (7-10), 16-byte unit
    // (4-6, swizzled by the row's low 3 bits), word (2-3). Rows 2q+1, 8+2q, 9+2q differ from row
    // 2q by these XORs (row bit 0 also flips the unit's bit 0).
    const uint32_t src_lane = (j << 11) | (q << 8) | ((((j / 4) ^ (2 * q)) & 7) << 4) | ((j % 4) << 2);
    constexpr uint32_t kRowFlip[4] = {0x000, 0x090, 0x400, 0x490};
    // Target offsets: head-dim row (7-14: 32k + 4j + c), 16-byte unit of keys (4-6: group ^ row
    // % 8), word (2-3: q).
    const uint32_t dst_lane = (j << 9) | ((j ^ ((j % 2) << 2)) << 4) | (q << 2);
#pragma unroll 1
    for (uint32_t m = warp; m < 8; m += kWarps) {
        const uint32_t src_m = src_lane ^ (m << 11), dst_m = dst_lane ^ (m << 4);
#pragma unroll 2  // two k's in flight: four spilled at head_dim 256 under the warps' 24 registers
        for (uint32_t k = 0; k < kColumns / 32; ++k) {
            const uint32_t from = src + (k / 4) * kChunkBytes;
            const uint32_t src_k = src_m ^ ((k % 4) << 5);
            const TransposedWords t = transpose_4x4_bytes(
                load_shared_word(from + (src_k ^ kRowFlip[0])), load_shared_word(from + (src_k ^ kRowFlip[1])),
                load_shared_word(from + (src_k ^ kRowFlip[2])), load_shared_word(from + (src_k ^ kRowFlip[3])));
            const uint32_t dst_k = dst_m ^ (k << 12);
            store_shared_word(dst + (dst_k ^ 0x000), t.b0);
            store_shared_word(dst + (dst_k ^ 0x090), t.b1);
            store_shared_word(dst + (dst_k ^ 0x120), t.b2);
            store_shared_word(dst + (dst_k ^ 0x1b0), t.b3);
        }
    }
}

}  // namespace fagen::algo
