// Rows of head_dim elements from global to shared memory with cp.async, 16-byte vectors, one
// padded row pitch: the Q, K and V tiles of the mma.sync kernels (FA1, FA2), and the e4m3 K/V
// rows of the split-KV kernel.
#pragma once
#include "fagen/ptx/cp_async.cuh"
#include "fagen/types.cuh"

namespace fagen::algo {

// Copies `kRows` rows of kHeadDim elements from global (row stride in elements) to shared
// memory at `smem` (rows kPitch bytes apart), kThreads threads taking part (`tid` in
// [0, kThreads)); rows at or past `rows_valid` are zero-filled.
template <class Element, int kRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void load_rows(uint32_t smem, const Element* src, long long row_stride,
                                          int rows_valid, int tid) {
    constexpr int kVecElements = 16 / static_cast<int>(sizeof(Element));
    static_assert(kHeadDim % kVecElements == 0, "rows move as 16-byte vectors");
    constexpr int kVecsPerRow = kHeadDim / kVecElements;
    constexpr int kVecs = kRows * kVecsPerRow;
    if constexpr (kThreads % kVecsPerRow == 0 && kVecs % kThreads == 0) {
        // Each thread owns one vector column and every kRowStep-th row: one running pointer
        // instead of a precomputed 64-bit offset per row (which costs registers).
        constexpr int kRowStep = kThreads / kVecsPerRow;
        const int vec = tid % kVecsPerRow;
        int row = tid / kVecsPerRow;
        const Element* g = src + row * row_stride + vec * kVecElements;
        const long long step = kRowStep * row_stride;
        uint32_t dst = smem + row * kPitch + vec * 16;
#pragma unroll
        for (int it = 0; it < kVecs / kThreads; ++it) {
            ptx::cp_async_cg_16(dst, g, row < rows_valid);
            g += step;
            row += kRowStep;
            dst += kRowStep * kPitch;
        }
    } else {
#pragma unroll
        for (int it = 0; it < (kVecs + kThreads - 1) / kThreads; ++it) {
            const int idx = tid + it * kThreads;
            if (kVecs % kThreads == 0 || idx < kVecs) {
                const int row = idx / kVecsPerRow;
                const int vec = idx % kVecsPerRow;
                const bool valid = row < rows_valid;
                const Element* g = src + (valid ? row : 0) * row_stride + vec * kVecElements;
                ptx::cp_async_cg_16(smem + row * kPitch + vec * 16, g, valid);
            }
        }
    }
}

}  // namespace fagen::algo
