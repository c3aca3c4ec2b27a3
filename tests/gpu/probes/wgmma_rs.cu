// Probe of ptx/wgmma.cuh (wgmma_rs<128, bf16 or f16, 1>: A from registers, B from shared memory
// MN-major / transposed) and ptx/wgmma_desc.cuh (wgmma_desc_swizzle128 with a leading byte
// offset), with ptx/wgmma_sync.cuh; B arrives by TMA (cp_async_bulk_tensor.cuh, mbarrier.cuh,
// fence.cuh). sm_90a; run by tests/gpu/test_ptx_probes.py.
//
// One warpgroup (128 threads) computes D (64 x 128, fp32) = C + A (64 x 64) @ B (64 x 128), the
// shape of O += P V in FA3 (fa3/forward.cuh issue_pv) with block_n = 64 keys, head_dim 128:
//   A: read from global memory into the mma.sync A-fragment layout (ptx/mma_sync.cuh), per
//      k-step kk: warp w, lane 4g+q holds a[0] = A[16w+g][16kk+2q, +1], a[1] = A[16w+g+8][same],
//      a[2] = A[16w+g][16kk+8+2q, +1], a[3] = A[16w+g+8][same] (low half = lower column).
//   B: K x N row-major (N contiguous, like V), TMA-loaded as two 64-column chunks of 64 rows x
//      128 bytes, chunk c at sB + c*64*128; descriptor start sB + kk*16*128, LBO = 64*128 (the
//      distance between N chunks), SBO = 1024 (8 K rows), tnspB = 1.
//   C: the initial accumulators (every k-step accumulates, as issue_pv does).
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/wgmma.cuh"
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/ptx/wgmma_sync.cuh"

using fagen::uint32_t;

namespace {

template <bool kBf16>
__device__ __forceinline__ void wgmma_rs_probe(const fagen::ptx::TensorMap& map_b,
                                               const unsigned short* a, const float* c, float* d) {
    constexpr int kN = 128, kK = 64;  // M = 64: one warpgroup, 16 rows per warp
    constexpr uint32_t kBBytes = kK * kN * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint32_t sb = (raw + 1023) & ~1023u;
    const uint32_t bar = sb + kBBytes;

    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_init(bar, 1);
        fagen::ptx::fence_mbarrier_init_release_cluster();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kBBytes);
        for (int ch = 0; ch < kN / 64; ++ch) {
            fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(sb + ch * kK * 128, &map_b, bar,
                                                                 ch * 64, 0, 0, 0);
        }
    }
    __syncwarp();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, q = lane % 4;
    auto pair = [&](int row, int col) -> uint32_t {
        return static_cast<uint32_t>(a[row * kK + col]) |
               (static_cast<uint32_t>(a[row * kK + col + 1]) << 16);
    };
    uint32_t frag[kK / 16][4];
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        const int r = 16 * warp + g, k0 = 16 * kk + 2 * q;
        frag[kk][0] = pair(r, k0);
        frag[kk][1] = pair(r + 8, k0);
        frag[kk][2] = pair(r, k0 + 8);
        frag[kk][3] = pair(r + 8, k0 + 8);
    }
    float acc[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[n][i] = c[(16 * warp + g + 8 * (i / 2)) * kN + 8 * n + 2 * q + (i % 2)];
        }

    fagen::ptx::mbarrier_wait_parity(bar, 0);
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) fagen::ptx::fence_operand(acc[n][i]);
    fagen::ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
        const unsigned long long desc_b =
            fagen::ptx::wgmma_desc_swizzle128(sb + kk * 16 * 128, kK * 128, 1024);
        fagen::ptx::wgmma_rs<kN, kBf16, 1>(acc, frag[kk], desc_b, 1);
    }
    fagen::ptx::wgmma_commit_group();
    fagen::ptx::wgmma_wait_group<0>();
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) fagen::ptx::fence_operand(acc[n][i]);

#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            d[(16 * warp + g + 8 * (i / 2)) * kN + 8 * n + 2 * q + (i % 2)] = acc[n][i];
        }
}

}  // namespace

// map_b: (128 cols, 64 rows, 1, 1), box (64, 64); a: 64 x 64 16-bit bit patterns; c, d: 64 x 128
// fp32. One block of 128 threads, dynamic shared memory 1024 + 16384 + 8 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_rs_bf16(const __grid_constant__ fagen::ptx::TensorMap map_b,
                        const unsigned short* a, const float* c, float* d) {
    wgmma_rs_probe<true>(map_b, a, c, d);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_rs_f16(const __grid_constant__ fagen::ptx::TensorMap map_b,
                       const unsigned short* a, const float* c, float* d) {
    wgmma_rs_probe<false>(map_b, a, c, d);
}
