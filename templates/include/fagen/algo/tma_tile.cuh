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

// The tile is kChunks column chunks of 64 elements (one 128-byte swizzle atom wide), each
// `rows` rows of 128 bytes, stored one after the other at `dst`, landing on mbarrier `full`; the
// caller announced the bytes on `full` (several tiles may land on one barrier) and made sure the
// slot is free.
template <int kChunks>
__device__ __forceinline__ void tma_copy_tile(const FagenTensorMap& map, uint32_t dst, int rows,
                                              uint32_t full, int row_begin, int head, int batch) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        ptx::cp_async_bulk_tensor_4d_global_to_shared(dst + c * rows * 128, &map, full, c * 64,
                                                      row_begin, head, batch);
    }
}

// tma_copy_tile of one tile that `full` is told the byte count of first.
template <int kChunks>
__device__ __forceinline__ void tma_load_tile(const FagenTensorMap& map, uint32_t dst, int rows,
                                              uint32_t full, int row_begin, int head, int batch) {
    ptx::mbarrier_arrive_expect_tx(full, kChunks * rows * 128);
    tma_copy_tile<kChunks>(map, dst, rows, full, row_begin, head, batch);
}

}  // namespace fagen::algo
