// cp.async.bulk.commit_group — closes the calling thread's current bulk group: the bulk copies
// and reductions it issued since the last commit (cp_reduce_async_bulk_tensor.cuh). Minimum
// arch: sm_90.
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ void cp_async_bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

}  // namespace fagen::ptx
