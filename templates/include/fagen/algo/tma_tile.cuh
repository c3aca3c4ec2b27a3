// One tile of a TMA shared-memory ring (Q, or the K or V of a key block), from global to shared
// memory, and the set-up around it. Shared by the TMA kernels (FA3, FA4).
#pragma once
#include "fagen/params.h"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/mbarrier.cuh"

namespace fagen::algo {

constexpr uint32_t kSwizzleAtomBytes = 1024;  // 8 rows x 128 bytes: the 128-byte swizzle's period

// Position `position` of a ring of kDepth shared-memory buffers filled in turn (TMA stages): its
// buffer, and the phase parity its full barrier completes (the empty barrier's is the opposite:
// a fresh barrier passes parity 1).
template <int kDepth>
__device__ __forceinline__ int ring_slot(int position) { return position % kDepth; }
template <int kDepth>
__device__ __forceinline__ uint32_t ring_parity(int position) {
    return static_cast<uint32_t>((position / kDepth) & 1);
}

// The shared address every tile offset is counted from: the dynamic shared window is only
// 16-byte aligned by contract, and the swizzle needs its tiles 1024-byte aligned.
__device__ __forceinline__ uint32_t swizzle_aligned_base(const char* smem) {
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return (raw + kSwizzleAtomBytes - 1) & ~(kSwizzleAtomBytes - 1);
}

// Pulls the tensor maps into the TMA unit's cache ahead of the first loads.
__device__ __forceinline__ void prefetch_tma_maps(const FagenTmaMaps& maps) {
    ptx::prefetch_tensormap(&maps.q);
    ptx::prefetch_tensormap(&maps.k);
    ptx::prefetch_tensormap(&maps.v);
}

// The tile is kChunks column chunks of kChunkColumns elements (one 128-byte swizzle atom wide:
// 64 of fp16/bf16, 128 of e4m3), each `rows` rows of 128 bytes, stored one after the other at
// `dst`, landing on mbarrier `full`; the caller announced the bytes on `full` (several tiles may
// land on one barrier) and made sure the slot is free.
template <int kChunks, int kChunkColumns = 64>
__device__ __forceinline__ void tma_copy_tile(const FagenTensorMap& map, uint32_t dst, int rows,
                                              uint32_t full, int row_begin, int head, int batch) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        ptx::cp_async_bulk_tensor_4d_global_to_shared(dst + c * rows * 128, &map, full, c * kChunkColumns,
                                                      row_begin, head, batch);
    }
}

// tma_copy_tile of one tile that `full` is told the byte count of first.
template <int kChunks, int kChunkColumns = 64>
__device__ __forceinline__ void tma_load_tile(const FagenTensorMap& map, uint32_t dst, int rows,
                                              uint32_t full, int row_begin, int head, int batch) {
    ptx::mbarrier_arrive_expect_tx(full, kChunks * rows * 128);
    tma_copy_tile<kChunks, kChunkColumns>(map, dst, rows, full, row_begin, head, batch);
}

// A V^T tile (fa3/forward.cuh, e4m3): kChunks chunks of kRows rows (the head dim) of one 128-byte
// swizzle row of keys from `key_begin` on, a box each of a map over (keys, rows, heads, batch)
// (algo/v_transpose.cuh).
template <int kRows, int kChunks>
__device__ __forceinline__ void tma_load_transposed_tile(const FagenTensorMap& map, uint32_t dst, uint32_t full,
                                                         int key_begin, int head, int batch) {
    ptx::mbarrier_arrive_expect_tx(full, kChunks * kRows * 128);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        ptx::cp_async_bulk_tensor_4d_global_to_shared(dst + c * kRows * 128, &map, full, key_begin + 128 * c, 0, head,
                                                      batch);
    }
}

// Where the runs of a K or V tile of kRows keys of a paged-layout batch row (algo/batch_row.cuh:
// kPagedRows) come from, from key `key_begin` on (a multiple of kRows), `keys` being the row's:
// runs of box_rows keys (cache_box_rows), each from its page of the block table, or from the
// row's block of a contiguous cache (no block table: the map's batch is the batch row). A run
// past the row's keys, or through a table entry outside [0, pages), reads coordinates outside
// the map: zeros, never another row's page. Every lookup is issued before any is used, and K and
// V share them: one memory latency per key block. Looked up run by run between the copies, the
// producer waited one latency per run, and a prefill over 16-key pages ran at 0.25-0.29x the
// varlen call's speed on the same keys (2026-12-04).
template <int kMaxRuns>
struct CacheRuns {
    int page[kMaxRuns];
    int row[kMaxRuns];
    int box_rows;
};

// Keys per TMA box (the host encoded the K/V maps with it; fagen/contract.py: cache_box_rows):
// the whole tile where a page (or a contiguous cache's row) holds whole tiles, a page where a
// tile holds whole pages, else runs of kMinBoxRows.
template <int kRows, int kMinBoxRows>
__device__ __forceinline__ int cache_box_rows(const FagenFwdParams& p) {
    if (p.block_table == nullptr || p.page_size % kRows == 0) return kRows;
    return kRows % p.page_size == 0 ? p.page_size : kMinBoxRows;
}

template <int kRows, int kMinBoxRows>
__device__ __forceinline__ CacheRuns<kRows / kMinBoxRows> cache_runs(const FagenFwdParams& p, int batch,
                                                                     int key_begin, int keys) {
    static_assert(kRows % kMinBoxRows == 0 && kMinBoxRows * 128 % kSwizzleAtomBytes == 0);
    CacheRuns<kRows / kMinBoxRows> runs;
    runs.box_rows = cache_box_rows<kRows, kMinBoxRows>(p);
#pragma unroll
    for (int r = 0; r < kRows / kMinBoxRows; ++r) {
        const int key = key_begin + r * runs.box_rows;
        runs.page[r] = batch;
        runs.row[r] = key;
        if (p.block_table != nullptr && r * runs.box_rows < kRows) {
            runs.page[r] = key < keys ? p.block_table[batch * p.block_table_batch_stride + key / p.page_size] : p.pages;
            runs.row[r] = key % p.page_size;
        }
    }
    return runs;
}

// The tile of `runs` into `dst`, each run in the place one box of kRows rows would put it (a run
// is whole swizzle atoms); `full` is told the tile's bytes first.
template <int kChunks, int kRows, int kMinBoxRows>
__device__ __forceinline__ void tma_load_cache_tile(const FagenTensorMap& map, uint32_t dst, uint32_t full,
                                                    const CacheRuns<kRows / kMinBoxRows>& runs, int head) {
    ptx::mbarrier_arrive_expect_tx(full, kChunks * kRows * 128);
#pragma unroll
    for (int r = 0; r < kRows / kMinBoxRows; ++r) {
        if (r * runs.box_rows >= kRows) break;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            ptx::cp_async_bulk_tensor_4d_global_to_shared(dst + c * kRows * 128 + r * runs.box_rows * 128, &map,
                                                          full, c * 64, runs.row[r], head, runs.page[r]);
        }
    }
}

// Paged: a page's rows past a batch row's keys hold whatever was written there before, not the
// zeros TMA gives past a dense tensor's end, and a masked P of 0 times a NaN there is NaN in O.
// This zeroes rows [first_row, kRows), first_row < kRows, of a tile that landed (kChunks column chunks of kRows x 128
// bytes, as tma_load_cache_tile writes them), `thread` one of kThreads; the caller fences the
// stores for the tensor cores' (async-proxy) reads and tells them.
template <int kChunks, int kRows, int kThreads>
__device__ __forceinline__ void zero_tile_rows(uint32_t tile, int first_row, int thread) {
    constexpr int kVectorsPerRow = 128 / 16;  // a chunk's row is 128 bytes
    const int vectors_per_chunk = (kRows - first_row) * kVectorsPerRow;
    for (int i = thread; i < kChunks * vectors_per_chunk; i += kThreads) {
        const int chunk = i / vectors_per_chunk, within = i % vectors_per_chunk;
        const uint32_t address = tile + chunk * kRows * 128 + first_row * 128 + within * 16;
        *static_cast<uint4*>(__cvta_shared_to_generic(address)) = make_uint4(0, 0, 0, 0);
    }
}

}  // namespace fagen::algo
