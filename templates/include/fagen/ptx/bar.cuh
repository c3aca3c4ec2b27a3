// bar.sync / bar.arrive with a named barrier id and thread count: synchronizes a subset of the
// CTA (e.g. two consumer warpgroups taking turns). Minimum arch: sm_70.
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace fagen::ptx
