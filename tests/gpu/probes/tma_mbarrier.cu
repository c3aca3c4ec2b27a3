// Probe of ptx/cp_async_bulk_tensor.cuh (TensorMap, prefetch_tensormap,
// cp_async_bulk_tensor_4d_global_to_shared), ptx/mbarrier.cuh (mbarrier_init,
// mbarrier_arrive_expect_tx, mbarrier_wait_parity / try_wait_parity) and ptx/fence.cuh
// (fence_mbarrier_init_release_cluster). sm_90a; run by tests/gpu/test_ptx_probes.py.
//
// The host encodes a 4-D tiled tensor map (head_dim, seqlen, heads, batch) with boxes of
// 64 columns x 64 rows and the 128-byte swizzle, as fagen.runtime.driver does for FA3. Thread 0
// initializes one mbarrier (1 arrival) and runs two phases on it:
//   phase 0: box at coordinates (c0a, r0a, ha, 0) into tile 0, wait parity 0;
//   phase 1: box at coordinates (c0b, r0b, hb, 0) into tile 1, wait parity 1.
// Each tile is 64 rows x 128 bytes, 1024-byte aligned. Then all threads copy the raw shared
// bytes of both tiles (16384) to `out`, so the host sees the swizzled layout and the zero fill
// of rows past the tensor.
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"

using fagen::uint32_t;

extern "C" __global__ void probe_tma(const __grid_constant__ fagen::ptx::TensorMap map,
                                     unsigned int* out, int c0a, int r0a, int ha, int c0b,
                                     int r0b, int hb) {
    constexpr uint32_t kTileBytes = 64 * 128;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint32_t tiles = (raw + 1023) & ~1023u;
    const uint32_t bar = tiles + 2 * kTileBytes;

    if (threadIdx.x == 0) {
        fagen::ptx::prefetch_tensormap(&map);
        fagen::ptx::mbarrier_init(bar, 1);
        fagen::ptx::fence_mbarrier_init_release_cluster();
    }
    __syncthreads();

    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kTileBytes);
        fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(tiles, &map, bar, c0a, r0a, ha, 0);
    }
    fagen::ptx::mbarrier_wait_parity(bar, 0);
    // Phase 1 must not have completed yet: nobody has arrived on it.
    if (threadIdx.x == 0 && fagen::ptx::mbarrier_try_wait_parity(bar, 1)) out[4096] = 0xBAD1u;
    __syncthreads();

    if (threadIdx.x == 0) {
        fagen::ptx::mbarrier_arrive_expect_tx(bar, kTileBytes);
        fagen::ptx::cp_async_bulk_tensor_4d_global_to_shared(tiles + kTileBytes, &map, bar, c0b,
                                                             r0b, hb, 0);
    }
    fagen::ptx::mbarrier_wait_parity(bar, 1);

    // Raw bytes of both tiles, 4 at a time.
    const unsigned int* words = reinterpret_cast<const unsigned int*>(smem + (tiles - raw));
    for (int i = threadIdx.x; i < 2 * kTileBytes / 4; i += blockDim.x) out[i] = words[i];
}
