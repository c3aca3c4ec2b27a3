// A K or V tile of a paged-layout batch row gathered row by row with cp.async, where TMA would
// copy it in 16-key boxes (FA3's Config::kGathersKv; fagen/contract.py: cache_box_rows): at
// 16-key pages eight boxes and eight block-table lookups a 128-key tile, and the prefill ran at
// 0.38-0.44x the varlen call on the same keys (2026-12-04). Here the producer warpgroup's 128
// threads copy the tile together, eight threads per 128-byte row chunk (a warp's copy is four
// whole rows of a chunk: whole 128-byte lines), each looking up the pages of its own rows once
// for K and V.
#pragma once
#include "fagen/algo/kv_cache.cuh"
#include "fagen/params.h"
#include "fagen/ptx/cp_async.cuh"

namespace fagen::algo {

constexpr int kGatherUnitBytes = 16;                             // one cp.async
constexpr int kGatherThreadsPerRow = 128 / kGatherUnitBytes;     // a 128-byte chunk row

// Where rows of the tile come from: per pass of the gather, the page of the thread's row (-1:
// the row reads as zeros: past the batch row's keys, or a block-table entry outside [0,
// pages)); its row in the page follows from the tile's first key. K and V share them.
template <int kRows, int kThreads>
struct GatherRows {
    static constexpr int kRowsPerPass = kThreads / kGatherThreadsPerRow;
    static constexpr int kPasses = kRows / kRowsPerPass;
    static_assert(kThreads % kGatherThreadsPerRow == 0 && kRows % kRowsPerPass == 0);
    int page[kPasses];
    int first_key;  // the thread's row's key in pass 0

    static __device__ __forceinline__ GatherRows of(const FagenFwdParams& p, int batch, int key_begin, int keys,
                                                    int thread) {
        GatherRows g;
        g.first_key = key_begin + thread / kGatherThreadsPerRow;
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
            const int key = g.first_key + i * kRowsPerPass;
            g.page[i] = key < keys ? cache_page(p, batch, key) : -1;
        }
        return g;
    }
};

// One tile (kChunks column chunks of kRows rows of 128 bytes, 128-byte swizzled as TMA would
// write it, `dst` 1024-byte aligned) from `base` (the tensor at the K/V head), committed as one
// cp.async group of this thread's copies.
template <int kChunks, int kRows, int kThreads, class Element>
__device__ __forceinline__ void gather_cache_tile(const FagenFwdParams& p, uint32_t dst, const Element* base,
                                                  long long page_stride, long long row_stride,
                                                  const GatherRows<kRows, kThreads>& rows, int thread) {
    constexpr int kChunkElements = 128 / static_cast<int>(sizeof(Element));
    constexpr int kUnitElements = kGatherUnitBytes / static_cast<int>(sizeof(Element));
    const int unit = thread % kGatherThreadsPerRow;
#pragma unroll
    for (int i = 0; i < GatherRows<kRows, kThreads>::kPasses; ++i) {
        const int row = i * GatherRows<kRows, kThreads>::kRowsPerPass + thread / kGatherThreadsPerRow;
        const bool valid = rows.page[i] >= 0;
        const int row_in_page = (rows.first_key + i * GatherRows<kRows, kThreads>::kRowsPerPass) % p.page_size;
        const Element* src = base + (valid ? rows.page[i] * page_stride + row_in_page * row_stride : 0);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            // The 128-byte swizzle: 16-byte unit u of a row lands at u ^ (row % 8).
            const uint32_t to = dst + (c * kRows + row) * 128 + ((unit ^ (row % 8)) * kGatherUnitBytes);
            ptx::cp_async_cg_16(to, src + c * kChunkElements + unit * kUnitElements, valid);
        }
    }
    ptx::cp_async_commit_group();
}

}  // namespace fagen::algo
