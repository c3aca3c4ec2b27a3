// Probe of ptx/ldmatrix.cuh (ldmatrix_x4, ldmatrix_x4_trans) and ptx/mma_sync.cuh
// (mma_sync_m16n8k16_f32_bf16, mma_sync_m16n8k16_f32_f16). Built for the device's own sm_XY
// (any cc >= 8.0); run by tests/gpu/test_ptx_probes.py.
//
// One warp: D (16x16 fp32) = A (16x16, row-major) @ B (16x16, K x N row-major) + C.
//   A: ldmatrix.x4 (no .trans) gives the A fragment directly: matrices 0..3 = rows 0-7/8-15 of
//      columns 0-7, then rows 0-7/8-15 of columns 8-15; lane l points at row l%16, column
//      8*(l/16).
//   B: stored K x N (N contiguous, like V); ldmatrix.x4.trans gives the column-major B fragments
//      of the two n8 tiles: matrices 0..3 = k 0-7/8-15 of n 0-7, then k 0-7/8-15 of n 8-15;
//      lane l points at row (k) l%16, column (n) 8*(l/16).
//   Two mma.sync m16n8k16 (n tiles 0 and 1), accumulating onto C.
#include "fagen/ptx/ldmatrix.cuh"
#include "fagen/ptx/mma_sync.cuh"

using fagen::uint32_t;

template <bool kBf16>
__device__ __forceinline__ void mma_probe(const unsigned short* a, const unsigned short* b,
                                          const float* c, float* d) {
    __shared__ alignas(16) unsigned short sa[16 * 16];
    __shared__ alignas(16) unsigned short sb[16 * 16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 16 * 16; i += 32) {
        sa[i] = a[i];
        sb[i] = b[i];
    }
    __syncwarp();

    uint32_t ra[4], rb[4];
    const int offset = ((lane % 16) * 16 + (lane / 16) * 8) * 2;  // bytes
    fagen::ptx::ldmatrix_x4(ra, static_cast<uint32_t>(__cvta_generic_to_shared(sa)) + offset);
    fagen::ptx::ldmatrix_x4_trans(rb, static_cast<uint32_t>(__cvta_generic_to_shared(sb)) + offset);

    const int g = lane / 4, q = lane % 4;
    float acc[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        acc[n][0] = c[g * 16 + 8 * n + 2 * q];
        acc[n][1] = c[g * 16 + 8 * n + 2 * q + 1];
        acc[n][2] = c[(g + 8) * 16 + 8 * n + 2 * q];
        acc[n][3] = c[(g + 8) * 16 + 8 * n + 2 * q + 1];
    }
    const uint32_t b0[2] = {rb[0], rb[1]};
    const uint32_t b1[2] = {rb[2], rb[3]};
    if constexpr (kBf16) {
        fagen::ptx::mma_sync_m16n8k16_f32_bf16(acc[0], ra, b0);
        fagen::ptx::mma_sync_m16n8k16_f32_bf16(acc[1], ra, b1);
    } else {
        fagen::ptx::mma_sync_m16n8k16_f32_f16(acc[0], ra, b0);
        fagen::ptx::mma_sync_m16n8k16_f32_f16(acc[1], ra, b1);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        d[g * 16 + 8 * n + 2 * q] = acc[n][0];
        d[g * 16 + 8 * n + 2 * q + 1] = acc[n][1];
        d[(g + 8) * 16 + 8 * n + 2 * q] = acc[n][2];
        d[(g + 8) * 16 + 8 * n + 2 * q + 1] = acc[n][3];
    }
}

// a: 16x16 16-bit bit patterns, b: 16x16 (K x N), c and d: 16x16 fp32. One block of 32 threads.
extern "C" __global__ void probe_mma_bf16(const unsigned short* a, const unsigned short* b,
                                         const float* c, float* d) {
    mma_probe<true>(a, b, c, d);
}

extern "C" __global__ void probe_mma_f16(const unsigned short* a, const unsigned short* b,
                                        const float* c, float* d) {
    mma_probe<false>(a, b, c, d);
}
