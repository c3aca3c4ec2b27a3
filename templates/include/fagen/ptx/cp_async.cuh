// cp.async.cg.shared.global (16 bytes, L2 only), cp.async.ca.shared.global (4 bytes),
// cp.async.commit_group, cp.async.wait_group.
// Minimum arch: sm_80.
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

// Copies 16 bytes when `valid`, else writes 16 zero bytes: with src-size 0 nothing is read, so
// `src` may point past the tensor and out-of-range rows arrive as zeros without a branch.
__device__ __forceinline__ void cp_async_cg_16(uint32_t smem_addr, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(smem_addr), "l"(src), "r"(src_bytes)
                 : "memory");
}

// The same for 4 bytes (cp.async allows .cg only for 16): one float of a per-row array.
__device__ __forceinline__ void cp_async_ca_4(uint32_t smem_addr, const void* src, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :
                 : "r"(smem_addr), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit_group() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace fagen::ptx
