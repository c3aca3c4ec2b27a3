// ex2.approx.ftz.f32 — the hardware base-2 exponential (MUFU.EX2). Minimum arch: sm_20.
// ex2(-inf) = +0, which the online softmax relies on for masked scores.
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace fagen::ptx
