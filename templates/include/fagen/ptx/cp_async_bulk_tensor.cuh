// cp.async.bulk.tensor.{4d}.shared::cluster.global.tile.mbarrier::complete_tx::bytes — a TMA
// tiled load of a box described by a tensor map into shared memory, completing on an mbarrier.
// Minimum arch: sm_90.
//
// The tensor map is the 128-byte CUtensorMap the host builds with cuTensorMapEncodeTiled
// (FagenTensorMap in params.h, the kernels' ABI). It is passed to the kernel as a
// `const __grid_constant__` parameter so its generic address may be used directly (kernel
// parameters live in the constant bank, which TMA can read).
#pragma once
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::ptx {

using TensorMap = FagenTensorMap;
static_assert(sizeof(TensorMap) == 128, "CUtensorMap is 128 bytes");

// Coordinates are innermost first, in elements: (column, row, head, batch).
__device__ __forceinline__ void cp_async_bulk_tensor_4d_global_to_shared(
    uint32_t smem_dst, const TensorMap* map, uint32_t bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :
        : "r"(smem_dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0),
          "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Pulls the tensor map into the TMA unit's cache ahead of the first load.
__device__ __forceinline__ void prefetch_tensormap(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map))
                 : "memory");
}

}  // namespace fagen::ptx
