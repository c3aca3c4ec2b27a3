// wgmma.fence / wgmma.commit_group / wgmma.wait_group — ordering around wgmma.mma_async.
// Minimum arch: sm_90a.
#pragma once

namespace fagen::ptx {

// Before the first wgmma that reads registers (accumulators or an A fragment) written by
// ordinary instructions, so the async unit sees their final values.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to `reg` across this point: accumulators that a
// wgmma in flight still writes must not be read or spilled early.
template <typename T>
__device__ __forceinline__ void fence_operand(T& reg) {
    asm volatile("" : "+f"(reg)::"memory");
}

// fence_operand over a whole accumulator (kN n8 tiles of four floats per thread).
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) fence_operand(acc[n][i]);
}

}  // namespace fagen::ptx
