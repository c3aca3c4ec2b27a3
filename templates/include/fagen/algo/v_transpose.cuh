// V^T for the 8-bit P V (fa3/forward.cuh with an e4m3 element). wgmma reads 8-bit B operands only
// K-major, but flash-attn's callers hold V as (batch, seqlen_k, heads_kv, head_dim_v), the head
// dim contiguous. The e4m3 forward's companion kernel (<name>_vt, fagen/contract.py:
// E4M3_VT_SUFFIX) writes V^T into the call's workspace first, (batch, heads_kv, head_dim_v,
// vt_keys) with vt_keys = seqlen_k rounded up to 16 (contract.vt_keys) and the padding zeros;
// the forward then loads V^T tiles with TMA like any other tile. FlashAttention-3 transposes
// each V tile in shared memory inside the kernel instead; fagen did too, with three producer
// warps, and they bounded the FP8 forward (docs/performance.md, entries 141-142 and 153).
//
// The keys are permuted within every 16 on the way. P's A fragment (ptx/wgmma.cuh, e4m3) gives
// lane 4g+q the columns 4q..4q+3 of each 16, but the S accumulator P is converted from
// (algo/fragment.cuh) holds columns 2q, 2q+1, 8+2q, 9+2q there. Packing those four as they are
// makes P's logical column 4q+i the physical key {2q, 2q+1, 8+2q, 9+2q}[i]; P V is a sum over
// keys, so it is exact when V^T's column 4q+i holds the same physical key. The conversion then
// needs no shuffles (algo/element.cuh: pack_a_fragment for e4m3).
#pragma once
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::algo {

// V^T's row length in keys (fagen/contract.py: vt_keys): whole groups of the 16 keys permuted
// together.
constexpr int kVtKeyGroup = 16;
__device__ __forceinline__ int vt_keys(int seqlen_k) { return (seqlen_k + kVtKeyGroup - 1) / kVtKeyGroup * kVtKeyGroup; }

// One CTA of the companion: kKeys keys of one (batch, kv head), blockIdx (key block, kv head,
// batch), kThreads threads. Each thread turns a 16 x 16 byte block (the 16 keys of group g, the
// 16 head-dim columns of chunk c) around in registers: 16 loads of 16 bytes (a key each), byte
// permutes, 16 stores of 16 bytes (a column each). A warp's lanes are 8 groups by 4 chunks, so
// every load reads 64 contiguous bytes of 8 key rows and every store writes 128 contiguous bytes
// (8 groups) of 4 V^T rows. Staged through shared memory with a thread per V^T row (16-byte
// stores, 32 rows per warp instruction), the companion moved 1.3-1.8 TB/s (2026-12-04).
template <int kKeys, int kColumns, int kThreads>
__device__ __forceinline__ void transpose_v_block(const FagenFwdParams& p, unsigned char* vt) {
    constexpr int kGroups = kKeys / kVtKeyGroup, kChunks = kColumns / 16;
    static_assert(kKeys % kVtKeyGroup == 0 && kGroups == 8 && kGroups * kChunks == kThreads,
                  "a thread per (group of 16 keys, 16 columns); a warp's lanes span the 8 groups");
    const int g = threadIdx.x % kGroups, c = threadIdx.x / kGroups;
    const int key_begin = blockIdx.x * kKeys + 16 * g, head = blockIdx.y, batch = blockIdx.z;
    const int row_keys = vt_keys(p.seqlen_k);
    if (key_begin >= row_keys) return;
    const unsigned char* v = static_cast<const unsigned char*>(p.v) + batch * p.v_batch_stride +
                             head * p.v_head_stride + 16 * c;
    uint4 keys[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        keys[k] = make_uint4(0, 0, 0, 0);
        if (key_begin + k < p.seqlen_k) keys[k] = *reinterpret_cast<const uint4*>(v + (key_begin + k) * p.v_row_stride);
    }
    unsigned char* out = vt + ((static_cast<long long>(batch) * p.heads_kv + head) * kColumns + 16 * c) * row_keys +
                         key_begin;
    auto word = [](const uint4& x, int i) { return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w; };
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // column 16c + j: byte j % 4 of word j / 4 of each key
        const uint32_t pick = (j % 4) | (4 + j % 4) << 4;  // byte j % 4 of the first, then of the second
        uint32_t words[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // logical keys 4q..4q+3: physical 2q, 2q+1, 8+2q, 9+2q
            const uint32_t low = __byte_perm(word(keys[2 * q], j / 4), word(keys[2 * q + 1], j / 4), pick);
            const uint32_t high = __byte_perm(word(keys[8 + 2 * q], j / 4), word(keys[9 + 2 * q], j / 4), pick);
            words[q] = __byte_perm(low, high, 0x5410);
        }
        *reinterpret_cast<uint4*>(out + static_cast<long long>(j) * row_keys) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
}

}  // namespace fagen::algo
