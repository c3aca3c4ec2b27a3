// Probe of the e4m3 wgmma wrappers (ptx/wgmma.cuh: wgmma_ss_e4m3, wgmma_rs_e4m3) with the pieces
// the FP8 forward builds their operands with: TMA boxes of 128 one-byte columns with the 128-byte
// swizzle, algo/v_transpose.cuh (the companion writing V^T with the keys permuted within every
// 16) and
// algo/element.cuh's pack_a_fragment for e4m3 (P from an fp32 accumulator). sm_90a; run by
// tests/gpu/test_ptx_probes.py.
//
// One warpgroup (128 threads):
//   probe_wgmma_ss_e4m3: D (64 x 128) = A (64 x 128, M x K) @ B^T, B (128 x 128, N x K), both
//     K-major as Q and K in Q K^T; k-step kk (4 of 32 columns = 32 bytes) at byte kk*32 of the
//     128-byte rows; LBO 16 (unused), SBO 1024. D starts as NaN (the first k-step overwrites).
//   probe_transpose_v_n{128,256}: the companion's transpose_v_block on one CTA: V (128 keys x N,
//     FagenFwdParams.v and its row stride) into V^T (N rows x 128 keys) at `vt`.
//   probe_wgmma_rs_e4m3_n{128,256}: D (64 x N) = C + P (64 x 128 keys) @ V (128 keys x N): P read
//     in the fp32 accumulator layout (algo/fragment.cuh) and packed by pack_a_fragment<e4m3>, the
//     V^T the companion wrote TMA-loaded as N rows x 128 bytes, read K-major with k-step kk at
//     byte kk*32.
#include "fagen/algo/element.cuh"
#include "fagen/algo/v_transpose.cuh"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/wgmma.cuh"
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/ptx/wgmma_sync.cuh"

using fagen::uint32_t;

namespace {

__device__ __forceinline__ uint32_t aligned_smem() {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return (raw + 1023) & ~1023u;
}

template <int kN>
__device__ __forceinline__ void fence_all(float (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) fagen::ptx::fence_operand(acc[n][i]);
}

// Row and column of accumulator element acc[n][i] of this thread (algo/fragment.cuh).
__device__ __forceinline__ int acc_row(int i) { return 16 * (threadIdx.x / 32) + (threadIdx.x % 32) / 4 + 8 * (i / 2); }
__device__ __forceinline__ int acc_col(int n, int i) { return 8 * n + 2 * (threadIdx.x % 4) + (i % 2); }

}  // namespace

// map_a: (128 cols, 64 rows), map_b: (128 cols, 128 rows), uint8 boxes (128, rows); d: 64 x 128
// fp32. Dynamic shared memory 1024 + 8192 + 16384 + 8 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_ss_e4m3(const __grid_constant__ fagen::ptx::TensorMap map_a,
                        const __grid_constant__ fagen::ptx::TensorMap map_b, float* d) {
    constexpr int kM = 64, kN = 128, kK = 128;
    const uint32_t sa = aligned_smem(), sb = sa + kM * kK, bar = sb + kN * kK;
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_init(bar, 1);
        fagen::ptx::fence_mbarrier_init_release_cluster();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kM * kK + kN * kK);
        fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(sa, &map_a, bar, 0, 0, 0, 0);
        fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(sb, &map_b, bar, 0, 0, 0, 0);
    }
    float acc[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = __int_as_float(0x7fc00000);
    fagen::ptx::mbarrier_wait_parity(bar, 0);
    fence_all(acc);
    fagen::ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 32; ++kk) {
        fagen::ptx::wgmma_ss_e4m3<kN>(acc, fagen::ptx::wgmma_desc_swizzle128(sa + kk * 32, 16, 1024),
                                      fagen::ptx::wgmma_desc_swizzle128(sb + kk * 32, 16, 1024), kk > 0);
    }
    fagen::ptx::wgmma_commit_group();
    fagen::ptx::wgmma_wait_group<0>();
    fence_all(acc);
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) d[acc_row(i) * kN + acc_col(n, i)] = acc[n][i];
}

template <int kN>
__device__ __forceinline__ void wgmma_rs_e4m3_probe(const fagen::ptx::TensorMap& map_vt, const float* p,
                                                    const float* c, float* d) {
    constexpr int kKeys = 128;
    const uint32_t svt = aligned_smem(), bar = svt + kN * kKeys;
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_init(bar, 1);
        fagen::ptx::fence_mbarrier_init_release_cluster();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kKeys * kN);
        fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(svt, &map_vt, bar, 0, 0, 0, 0);
    }
    // P in the S accumulator layout, then as e4m3 A fragments.
    float s[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = p[acc_row(i) * kKeys + acc_col(n, i)];
    uint32_t frag[kKeys / 32][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 32; ++kk) fagen::algo::pack_a_fragment<__nv_fp8_e4m3>(frag[kk], s, kk);
    float acc[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = c[acc_row(i) * kN + acc_col(n, i)];

    fagen::ptx::mbarrier_wait_parity(bar, 0);
    fence_all(acc);
    fagen::ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 32; ++kk) {
        fagen::ptx::wgmma_rs_e4m3<kN>(acc, frag[kk], fagen::ptx::wgmma_desc_swizzle128(svt + kk * 32, 16, 1024), 1);
    }
    fagen::ptx::wgmma_commit_group();
    fagen::ptx::wgmma_wait_group<0>();
    fence_all(acc);
#pragma unroll
    for (int n = 0; n < kN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) d[acc_row(i) * kN + acc_col(n, i)] = acc[n][i];
}

// map_vt: (128 keys, N rows), uint8 boxes (128, N); p: 64 x 128 fp32 (values exact in e4m3); c,
// d: 64 x N fp32. Dynamic shared memory 1024 + 128 * N + 8 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_rs_e4m3_n128(const __grid_constant__ fagen::ptx::TensorMap map_vt, const float* p,
                             const float* c, float* d) {
    wgmma_rs_e4m3_probe<128>(map_vt, p, c, d);
}

extern "C" __global__ void __launch_bounds__(128, 1)
    probe_wgmma_rs_e4m3_n256(const __grid_constant__ fagen::ptx::TensorMap map_vt, const float* p,
                             const float* c, float* d) {
    wgmma_rs_e4m3_probe<256>(map_vt, p, c, d);
}

// One CTA of N / 2 threads (the companion's block for 128 keys).
extern "C" __global__ void probe_transpose_v_n128(const __grid_constant__ FagenFwdParams p, unsigned char* vt) {
    fagen::algo::transpose_v_block<128, 128, 64>(p, vt);
}

extern "C" __global__ void probe_transpose_v_n256(const __grid_constant__ FagenFwdParams p, unsigned char* vt) {
    fagen::algo::transpose_v_block<128, 256, 128>(p, vt);
}
