// Tensor Memory for a whole CTA of the FA4 kernels (fa4/forward.cuh, fa4/backward.cuh): one warp
// allocates, every thread learns the base address behind a CTA barrier, and the same warp frees
// the columns once every thread is done with them.
#pragma once
#include "fagen/ptx/tcgen05_alloc.cuh"
#include "fagen/ptx/tcgen05_fence.cuh"
#include "fagen/types.cuh"

namespace fagen::algo {

// The base allocate_tmem wrote to `slot`, read again: a kernel whose roles take it after their
// setmaxnreg reads it there, since a value kept across setmaxnreg is spilled.
__device__ __forceinline__ uint32_t tmem_base(uint32_t slot) {
    return *static_cast<const uint32_t*>(__cvta_shared_to_generic(slot));
}

// kColumns of TMEM, allocated by the threads with `allocating_warp` set (one whole warp), their
// base written to the shared-memory word `slot`; returns the base in every thread. The CTA
// barrier inside also publishes what the CTA wrote before it (the mbarriers' initialisation).
template <uint32_t kColumns>
__device__ __forceinline__ uint32_t allocate_tmem(uint32_t slot, bool allocating_warp) {
    if (allocating_warp) {
        ptx::tcgen05_alloc(slot, kColumns);
        ptx::tcgen05_relinquish_alloc_permit();
    }
    ptx::tcgen05_fence_before_thread_sync();
    __syncthreads();
    ptx::tcgen05_fence_after_thread_sync();
    return tmem_base(slot);
}

// Frees what allocate_tmem gave, after every thread of the CTA has finished with it.
template <uint32_t kColumns>
__device__ __forceinline__ void release_tmem(uint32_t base, bool allocating_warp) {
    ptx::tcgen05_fence_before_thread_sync();
    __syncthreads();
    if (allocating_warp) {
        ptx::tcgen05_fence_after_thread_sync();
        ptx::tcgen05_dealloc(base, kColumns);
    }
}

}  // namespace fagen::algo
