// Probe of ptx/cp_async.cuh (cp_async_cg_16 with zero-fill, cp_async_commit_group,
// cp_async_wait_group<1> and <0>). Built for the device's own sm_XY (any cc >= 8.0); run by
// tests/gpu/test_ptx_probes.py.
//
// 128 threads copy a tile of 32 rows x 128 bytes (32 ints per row) into shared memory, 16 bytes
// per cp.async: group 0 = rows 0-15 (chunk t of thread t), group 1 = rows 16-31 (chunk t + 128).
// Row r is valid when r < n_rows and row_valid[r] != 0; invalid rows must arrive as zeros.
// Rows at or past n_rows get a source address past the end of `src` (src-size 0 reads nothing).
// Shared memory is first filled with 0x5A5A5A5A so zero-fill is observed, not assumed. After
// wait_group<1> each thread writes out its group-0 chunk; after wait_group<0>, its group-1 chunk.
#include "fagen/ptx/cp_async.cuh"

using fagen::uint32_t;

extern "C" __global__ void probe_cp_async(const int* src, const int* row_valid, int n_rows,
                                          int* out) {
    constexpr int kRows = 32, kIntsPerRow = 32, kChunksPerRow = 8;  // 16-byte chunks
    __shared__ alignas(16) int tile[kRows * kIntsPerRow];
    const int t = threadIdx.x;
    for (int i = t; i < kRows * kIntsPerRow; i += blockDim.x) tile[i] = 0x5A5A5A5A;
    __syncthreads();

    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
#pragma unroll
    for (int group = 0; group < 2; ++group) {
        const int chunk = t + group * 128;
        const int row = chunk / kChunksPerRow;
        const int col = (chunk % kChunksPerRow) * 4;  // ints
        const bool valid = row < n_rows && row_valid[row] != 0;
        fagen::ptx::cp_async_cg_16(base + (row * kIntsPerRow + col) * 4,
                                   src + row * kIntsPerRow + col, valid);
        fagen::ptx::cp_async_commit_group();
    }

    // Group 0 (issued first) is complete; group 1 may still be in flight.
    fagen::ptx::cp_async_wait_group<1>();
    {
        const int chunk = t;
        const int at = (chunk / kChunksPerRow) * kIntsPerRow + (chunk % kChunksPerRow) * 4;
        for (int i = 0; i < 4; ++i) out[at + i] = tile[at + i];
    }
    fagen::ptx::cp_async_wait_group<0>();
    {
        const int chunk = t + 128;
        const int at = (chunk / kChunksPerRow) * kIntsPerRow + (chunk % kChunksPerRow) * 4;
        for (int i = 0; i < 4; ++i) out[at + i] = tile[at + i];
    }
}
