// 2^x in software on the FMA pipe (FlashAttention-4, "software emulation of the exponential").
//
// On Blackwell the tensor core outruns MUFU.EX2 (16 exponentials per SM per clock), so softmax
// becomes the bottleneck; FMA units sit idle beside it. Computing a fraction of the
// exponentials with a polynomial spreads the work over both pipes. The result goes into a bf16
// or fp16 probability, so a cubic (relative error 8.6e-5, far below bf16's 2^-9 rounding)
// suffices.
//
// Range reduction: x = n + f with n = floor(x), f in [0, 1); 2^f by the polynomial; 2^n by
// adding n to the exponent field. Inputs at or below -127 (including the -inf of masked scores)
// give exactly +0, as ex2.approx.ftz does.
#pragma once
#include "fagen/ptx/ex2.cuh"

namespace fagen::algo {

// p(f) = 1 + f (c1 + f (c2 + f c3)): minimax fit of 2^f on [0, 1) in relative error with p(0)
// fixed to 1 (powers of two stay exact). Max relative error 8.57e-5 over [0, 1) evaluated in
// fp32 Horner form; p(1) = 1.99983, so the mantissa never carries into the exponent.
// Reproduced by tests/unit/fa4_model.py (fit_exp2_polynomial), which checks these digits.
constexpr float kExp2PolyC1 = 0.6951165199279785f;
constexpr float kExp2PolyC2 = 0.2276461124420166f;
constexpr float kExp2PolyC3 = 0.07706601917743683f;
constexpr float kExp2PolyLowest = -127.f;  // 2^-127 is below fp32's normal range: result +0

__device__ __forceinline__ float exp2_polynomial(float x) {
    x = fmaxf(x, kExp2PolyLowest);
    const float n = floorf(x);
    const float f = x - n;
    const float p = fmaf(fmaf(fmaf(kExp2PolyC3, f, kExp2PolyC2), f, kExp2PolyC1), f, 1.f);
    return __int_as_float(__float_as_int(p) + (static_cast<int>(n) << 23));
}

// The softmax exponential of element pair `pair` of a row: every kPeriod-th pair (pair %
// kPeriod == kPeriod - 1) takes the polynomial, the others MUFU.EX2, so a fraction 1/kPeriod of
// the exponentials runs on the FMA pipe; kPeriod = 0 uses the hardware unit only. `pair` is a
// compile-time constant after unrolling, so the choice costs no branch.
template <int kPeriod>
__device__ __forceinline__ float softmax_exp2(int pair, float x) {
    if constexpr (kPeriod > 0) {
        if (pair % kPeriod == kPeriod - 1) return exp2_polynomial(x);
    }
    return ptx::ex2_approx_ftz(x);
}

}  // namespace fagen::algo
