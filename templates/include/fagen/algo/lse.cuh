// The row LSE between the two units it lives in: base 2 inside the kernels (the forward's
// exponents are fmaf(s, scale_log2, -m2) with m2 = fl(m * scale_log2), so a row's sum l is
// relative to m2 and its base-2 LSE is m2 + log2 l), natural log in the API (flash-attn's
// softmax_lse). Both directions are here so that they invert each other with the same constant.
//
// Why the care: the backward recomputes P = exp2(fmaf(s, scale_log2, -LSE2)), and where one key
// dominates a row (P ~ 1) every rounding of LSE2 becomes a relative error of P, so of dV and of
// dS. With scores of thousands in base-2 units (inputs x8, softmax_scale 1) an fp32 ulp of LSE2 is
// 2^-12..2^-10: the former conversion (fl(m * scale_log2) re-derived inside an FMA, a rounding of
// the sum, a multiply by ln 2, and a multiply by a log2(e) that is not fl(ln 2)'s inverse) put
// two to three ulps there, enough to take fp16 gradients past 3x torch's error at seqlen_k = 1.
// Now: one rounding each way.
#pragma once
#include "fagen/algo/fragment.cuh"

namespace fagen::algo {

constexpr float kLn2 = 0.6931471805599453f;

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
