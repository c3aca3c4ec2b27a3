// tcgen05.fence::before_thread_sync / tcgen05.fence::after_thread_sync. Minimum arch: sm_100a.
//
// tcgen05 operations are asynchronous and not ordered by ordinary barriers on their own. A
// thread that hands TMEM (or a tcgen05 result) to another thread executes before_thread_sync
// ahead of the synchronizing operation (mbarrier arrive, bar.sync); the receiving thread
// executes after_thread_sync behind its side of the synchronization (mbarrier wait, bar.sync)
// and before its own tcgen05 operations.
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ void tcgen05_fence_before_thread_sync() {
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
}

__device__ __forceinline__ void tcgen05_fence_after_thread_sync() {
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
}

}  // namespace fagen::ptx
