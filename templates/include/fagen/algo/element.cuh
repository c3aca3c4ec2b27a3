// Per-element-type operations every kernel shares (the element axis of the kernel model): packing
// two floats into the 32-bit operand register, rounding to the element type, the matching
// mma.sync, and the A-operand fragment of P. fp16 and bf16 today; FP8 takes its slot here.
#pragma once
#include "fagen/types.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fagen/ptx/mma_sync.cuh"

namespace fagen::algo {

template <typename Element>
struct ElementOps;

template <>
struct ElementOps<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t pair) {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
    }
    // x as a matrix operand holds it (round to nearest, as pack).
    static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
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
    static __device__ __forceinline__ float2 unpack(uint32_t pair) {
        return __half22float2(*reinterpret_cast<const __half2*>(&pair));
    }
    static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
        ptx::mma_sync_m16n8k16_f32_f16(d, a, b);
    }
};

// The k16 A operand fragment of mma.sync m16n8k16 (and of wgmma with A from registers) for
// columns 16*kk .. 16*kk+15 of an fp32 accumulator in the row-pair layout of
// algo/fragment.cuh: P for P V, converted straight from the S accumulator.
template <class Element, int kN>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&a)[4], const float (&acc)[kN][4],
                                                int kk) {
    using Ops = ElementOps<Element>;
    a[0] = Ops::pack(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = Ops::pack(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = Ops::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = Ops::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

}  // namespace fagen::algo
