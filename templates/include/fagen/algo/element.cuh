// Per-element-type operations every kernel shares (the element axis of the kernel model): packing
// floats into the 32-bit operand register, rounding to the element type, the matching mma.sync,
// and the A-operand fragment of P. fp16 and bf16 (2 bytes, pairs per register), and e4m3 (1 byte,
// quadruples per register; the FA3 forward's FP8 path, whose output is bf16). fp16 also widens
// e4m3 pairs into its operand register (an e4m3 KV cache under 16-bit queries).
#pragma once
#include "fagen/types.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fagen/ptx/mma_sync.cuh"

namespace fagen::algo {

template <typename Element>
struct ElementOps;

template <>
struct ElementOps<__nv_bfloat16> {
    static constexpr float kProbabilityLog2Offset = 0.f;  // algo/online_softmax.cuh
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
    static constexpr float kProbabilityLog2Offset = 0.f;
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
    // widen_e4m3's results are the values times 2^kWidenedE4m3Log2.
    static constexpr int kWidenedE4m3Log2 = -8;
    // Two e4m3 values of `bytes` (its bytes 0 and 2, or with kOddBytes 1 and 3) as a pair, the
    // lower byte in the lower half: e4m3 s.eeee.mmm (bias 7) moves to fp16 s.0eeee.mmm0000000
    // (bias 15), the value times 2^-8, subnormals included, exact without a multiplication (the
    // kernel folds 2^8 into its scales).
    template <bool kOddBytes>
    static __device__ __forceinline__ uint32_t widen_e4m3(uint32_t bytes) {
        return kOddBytes ? (bytes & 0x80008000u) | ((bytes >> 1) & 0x3f803f80u)
                         : ((bytes << 8) & 0x80008000u) | ((bytes << 7) & 0x3f803f80u);
    }
};

// e4m3 (OCP FP8, max 448): values past 448 saturate to it instead of becoming NaN.
template <>
struct ElementOps<__nv_fp8_e4m3> {
    // P is taken up to 2^8 = 256, e4m3's largest power of two below 448, so that the rounding
    // keeps 3 mantissa bits further down (algo/online_softmax.cuh).
    static constexpr float kProbabilityLog2Offset = 8.f;
    static __device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
        return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
    }
    // Four floats as one operand register, the first in the lowest byte.
    static __device__ __forceinline__ uint32_t pack(float x0, float x1, float x2, float x3) {
        return pack_pair(x0, x1) | (pack_pair(x2, x3) << 16);
    }
    static __device__ __forceinline__ float round(float x) {
        const __nv_fp8_storage_t bits = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
        return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3)));
    }
};

// D0 += A B0 and D1 += A B1 (mma.sync m16n8k16) for the two n8 tiles of B an ldmatrix.x4 gave:
// b[0], b[1] the first tile's k halves, b[2], b[3] the second's.
template <class Ops>
__device__ __forceinline__ void mma_two_n8(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                           const uint32_t (&b)[4]) {
    const uint32_t b0[2] = {b[0], b[1]};
    const uint32_t b1[2] = {b[2], b[3]};
    Ops::mma(d0, a, b0);
    Ops::mma(d1, a, b1);
}

// Keys of P V per k-step (and per A fragment of 4 registers): 16 of 2-byte elements, 32 of e4m3.
template <class Element>
inline constexpr int kPvStepKeys = 32 / static_cast<int>(sizeof(Element));

// The A operand fragment of P V's k-step kk (mma.sync m16n8k16 and wgmma with A from registers,
// ptx/wgmma.cuh) from an fp32 accumulator in the row-pair layout of algo/fragment.cuh: P,
// converted straight from the S accumulator. 2-byte elements: columns 16*kk .. 16*kk+15 in
// order. e4m3: the 32 columns from 32*kk on, each register packing a row's columns of two
// neighbouring n8 tiles as the thread holds them (2q, 2q+1 of each): the key order V^T must
// follow (algo/v_transpose.cuh).
template <class Element, int kN>
__device__ __forceinline__ void pack_a_fragment(uint32_t (&a)[4], const float (&acc)[kN][4],
                                                int kk) {
    using Ops = ElementOps<Element>;
    if constexpr (sizeof(Element) == 1) {
        const int n = 4 * kk;
        a[0] = Ops::pack(acc[n][0], acc[n][1], acc[n + 1][0], acc[n + 1][1]);
        a[1] = Ops::pack(acc[n][2], acc[n][3], acc[n + 1][2], acc[n + 1][3]);
        a[2] = Ops::pack(acc[n + 2][0], acc[n + 2][1], acc[n + 3][0], acc[n + 3][1]);
        a[3] = Ops::pack(acc[n + 2][2], acc[n + 2][3], acc[n + 3][2], acc[n + 3][3]);
    } else {
        a[0] = Ops::pack(acc[2 * kk][0], acc[2 * kk][1]);
        a[1] = Ops::pack(acc[2 * kk][2], acc[2 * kk][3]);
        a[2] = Ops::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
        a[3] = Ops::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
    }
}

}  // namespace fagen::algo
