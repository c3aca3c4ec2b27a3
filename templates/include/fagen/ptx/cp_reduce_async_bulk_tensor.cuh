// cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group — a TMA reduction: adds
// a box of shared memory, laid out as the tensor map describes it (its swizzle included), to
// global memory element by element, atomically per element. Minimum arch: sm_90.
//
// Completion is tracked by bulk groups (cp_async_bulk_commit_group.cuh,
// cp_async_bulk_wait_group.cuh), not by an mbarrier: the issuing thread commits the group and
// waits on it before the shared memory is written again. Elements outside the tensor's bounds are
// not written.
#pragma once
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::ptx {

// Coordinates are innermost first, in elements: (column, row, head, batch).
__device__ __forceinline__ void cp_reduce_async_bulk_tensor_4d_add(const FagenTensorMap* map, uint32_t smem_src,
                                                                   int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
        " [%0, {%2, %3, %4, %5}], [%1];\n"
        :
        : "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

}  // namespace fagen::ptx
