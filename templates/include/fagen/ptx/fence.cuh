// fence.proxy.async.shared::cta, fence.proxy.async.global and fence.mbarrier_init.release.cluster.
// Minimum arch: sm_90.
#pragma once

namespace fagen::ptx {

// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (TMA stores, wgmma operand reads) of the same memory.
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The same for global memory: orders this thread's generic-proxy accesses (e.g. the acquire of a
// counter another CTA released after its TMA reductions) before its later async-proxy ones (its
// own TMA reductions of the same memory).
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Makes mbarrier.init visible to the async proxy (TMA completes on the barrier) and to the
// other threads, once followed by a CTA barrier.
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace fagen::ptx
