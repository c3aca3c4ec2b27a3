// tcgen05.alloc / tcgen05.dealloc / tcgen05.relinquish_alloc_permit, .cta_group::1 — allocation
// of Tensor Memory (TMEM), the 128-lane x 512-column array of 32-bit cells beside the 5th
// generation tensor core. Minimum arch: sm_100a.
//
// All three are .sync.aligned: every thread of one warp executes them together. Columns come in
// powers of two from 32 to 512. The allocated base address (lane in bits 31-16, column in bits
// 15-0) is written to shared memory, where the other warps read it after a CTA barrier.
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

// Writes the TMEM base address of `columns` fresh columns to the shared-memory word `slot`.
__device__ __forceinline__ void tcgen05_alloc(uint32_t slot, uint32_t columns) {
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n"
                 ::"r"(slot), "r"(columns) : "memory");
}

// Every allocation must be released before the kernel exits.
__device__ __forceinline__ void tcgen05_dealloc(uint32_t tmem_base, uint32_t columns) {
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n"
                 ::"r"(tmem_base), "r"(columns) : "memory");
}

// Lets another CTA resident on this SM allocate while this one still runs; after it this CTA
// may not allocate again.
__device__ __forceinline__ void tcgen05_relinquish_alloc_permit() {
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}

}  // namespace fagen::ptx
