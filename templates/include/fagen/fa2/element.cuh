// Per-element-type operations of the mma.sync kernels: packing two floats into the 32-bit
// operand register and the matching MMA.
#pragma once
#include "fagen/types.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fagen/ptx/mma_sync.cuh"

namespace fagen::fa2 {

template <typename Element>
struct ElementOps;

template <>
struct ElementOps<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
        ptx::mma_sync_m16n8k16_f32_bf16(d, a, b);
    }
};

template <>
struct ElementOps<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
        ptx::mma_sync_m16n8k16_f32_f16(d, a, b);
    }
};

}  // namespace fagen::fa2
