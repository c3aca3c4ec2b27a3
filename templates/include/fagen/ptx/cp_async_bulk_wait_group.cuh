// cp.async.bulk.wait_group[.read] N — waits until at most N of the calling thread's committed
// bulk groups are pending. With .read, only until their shared-memory sources have been read (the
// buffer may be written again); without, until they are complete (their global writes
// performed). Minimum arch: sm_90.
#pragma once

namespace fagen::ptx {

template <int kPending>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

template <int kPending>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace fagen::ptx
