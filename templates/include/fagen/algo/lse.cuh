// The row LSE between the two units it lives in (base 2 inside the kernels, natural log in the
// API: flash-attn's softmax_lse), and the backward's exponent, which must agree with both.
//
// The forward takes a score's exponent as fmaf(s, scale_log2, -m2), m2 = fl(m * scale_log2) for the
// row's reference maximum m: one rounding per score. The largest key's exponent is then not 0
// but r = m * scale_log2 - m2 (at most half an ulp of m2), a factor 2^r common to the whole row
// that O / l and LSE2 = m2 + log2 l cancel (algo/online_softmax.cuh keeps O's numerator and l
// consistent where P V rounds P).
//
// The backward recomputes P = exp2(fl(s * scale_log2) - LSE2): two roundings, deliberately not one
// FMA. Where one key dominates a row (few keys, large scores), l = 2^r (1 + tiny) and LSE2 =
// fl(m2 + r + tiny) = m2, so that key's exponent is exactly 0 and its P exactly 1, as the
// forward's normalised P is; an FMA would give 2^r again, an error of up to half an ulp of m2 in P
// (2^-8 relative at scores of 2^16 in base-2 units), hence in dV, with inputs x16 and outliers.
// LSE2 equals m2 only when the natural-log round trip below is exact: 86 % of fp32 values; the
// others are an ulp off, which no single fp32 natural-log LSE avoids.
#pragma once
#include "fagen/algo/fragment.cuh"

namespace fagen::algo {

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

// The backward's exponent: fl(s * scale_log2) - lse2, never contracted into an FMA (see the top of
// this file).
__device__ __forceinline__ float backward_exponent(float s, float scale_log2, float lse2) {
    return __fsub_rn(__fmul_rn(s, scale_log2), lse2);
}

// The natural-log LSE of a finished row whose exponents were taken against m2 (the subtrahend
// the kernel used, 0 for an empty row) and whose complete sum is `sum`: -inf for a row that saw
// no key. m2 * ln 2 is exact inside the FMA; log2(sum) is small, so its product rounds little.
__device__ __forceinline__ float natural_lse(float m2, float sum) {
    return sum == 0.f ? neg_inf() : fmaf(m2, kLn2, __log2f(sum) * kLn2);
}

// The base-2 LSE the backward subtracts: natural_lse's inverse (a correctly rounded division by
// the same constant), +inf for a row that saw no key, so that its probabilities are exp2(-inf) = 0.
__device__ __forceinline__ float base2_lse(float lse) {
    return lse == neg_inf() ? -neg_inf() : __fdiv_rn(lse, kLn2);
}

}  // namespace fagen::algo
