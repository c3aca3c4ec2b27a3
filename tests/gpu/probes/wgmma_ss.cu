// Probe of ptx/wgmma.cuh (wgmma_ss<128, bf16 or f16, 0>: both operands from shared memory,
// K-major), ptx/wgmma_desc.cuh (wgmma_desc_swizzle128) and ptx/wgmma_sync.cuh (wgmma_fence,
// wgmma_commit_group, wgmma_wait_group<0>, fence_operand); the tiles arrive by TMA
// (cp_async_bulk_tensor.cuh, mbarrier.cuh, fence.cuh). sm_90a; run by
// tests/gpu/test_ptx_probes.py.
//
// One warpgroup (128 threads) computes D (64 x 128, fp32) = A (64 x 128, M x K) @ B^T, with
// B (128 x 128, N x K) K-major like K in Q K^T. Both are TMA-loaded with the 128-byte swizzle in
// 64-column chunks of 128-byte rows, as FA3 loads Q and K (fa3/forward.cuh): chunk c of A at
// sA + c*64*128, chunk c of B at sB + c*128*128. k-step kk (8 of 16 columns) reads chunk kk/4 at
// byte offset (kk%4)*32 into the row; LBO 16 (unused), SBO 1024 (8 rows x 128 bytes).
// The accumulators start as NaN: the first k-step (scale-d = 0) must overwrite, not add.
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/wgmma.cuh"
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/ptx/wgmma_sync.cuh"

using fagen::uint32_t;

namespace {

template <bool kBf16>
__device__ __forceinline__ void wgmma_ss_probe(const fagen::ptx::TensorMap& map_a,
                                               const fagen::ptx::TensorMap& map_b, float* d) {
    constexpr int kM = 64, kN = 128, kK = 128;
    constexpr uint32_t kABytes = kM * kK * 2, kBBytes = kN * kK * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint32_t sa = (raw + 1023) & ~1023u;
    const uint32_t sb = sa + kABytes;
    const uint32_t bar = sb + kBBytes;

    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_init(bar, 1);
        fagen::ptx::fence_mbarrier_init_release_cluster();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kABytes + kBBytes);
        for (int c = 0; c < kK / 64; ++c) {
            fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(sa + c * kM * 128, &map_a, bar,
                                                                 c * 64, 0, 0, 0);
            fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(sb + c * kN * 128, &map_b, bar,
                                                                 c * 64, 0, 0, 0);
        }
    }
    __syncwarp();
    fagen::ptx::mbarrier_wait_parity(bar, 0);

    float acc[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = __int_as_float(0x7fc00000);

    fagen::ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        const int chunk = kk / 4;
        const uint32_t k_offset = (kk % 4) * 32;
        const unsigned long long desc_a =
            fagen::ptx::wgmma_desc_swizzle128(sa + chunk * kM * 128 + k_offset, 16, 1024);
        const unsigned long long desc_b =
            fagen::ptx::wgmma_desc_swizzle128(sb + chunk * kN * 128 + k_offset, 16, 1024);
        fagen::ptx::wgmma_ss<kN, kBf16, 0>(acc, desc_a, desc_b, kk > 0);
    }
    fagen::ptx::wgmma_commit_group();
    fagen::ptx::wgmma_wait_group<0>();
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) fagen::ptx::fence_operand(acc[n][i]);

    // Accumulator layout (algo/fragment.cuh): warp w holds rows 16w..16w+15; acc[n][0..1] are
    // row g, columns 8n+2q, +1; acc[n][2..3] row g+8 (lane = 4g + q).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = 16 * warp + g + 8 * (i / 2);
            const int col = 8 * n + 2 * q + (i % 2);
            d[row * kN + col] = acc[n][i];
        }
}

}  // namespace

// map_a: (128 cols, 64 rows, 1, 1), box (64, 64); map_b: (128 cols, 128 rows, 1, 1), box
// (64, 128); d: 64 x 128 fp32. One block of 128 threads, dynamic shared memory
// 1024 + 16384 + 32768 + 8 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_ss_bf16(const __grid_constant__ fagen::ptx::TensorMap map_a,
                        const __grid_constant__ fagen::ptx::TensorMap map_b, float* d) {
    wgmma_ss_probe<true>(map_a, map_b, d);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_ss_f16(const __grid_constant__ fagen::ptx::TensorMap map_a,
                       const __grid_constant__ fagen::ptx::TensorMap map_b, float* d) {
    wgmma_ss_probe<false>(map_a, map_b, d);
}
