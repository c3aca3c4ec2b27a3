// tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 — makes an mbarrier
// track completion of the asynchronous tcgen05 operations (mma, cp, shift) this thread issued
// before it. Minimum arch: sm_100a.
//
// The barrier receives one arrival once all of them have completed, so a consumer waiting on
// the barrier's phase may read their results (after tcgen05_fence_after_thread_sync) and a
// producer may reuse the shared memory they read.
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

__device__ __forceinline__ void tcgen05_commit(uint32_t bar) {
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n"
                 ::"r"(bar) : "memory");
}

}  // namespace fagen::ptx
