// setmaxnreg.{inc,dec}.sync.aligned.u32 — moves registers between the warpgroups of a CTA.
// Minimum arch: sm_90a. Takes effect only when the kernel has a register cap at entry
// (__launch_bounds__(threads, 1)); every warp of the warpgroup must execute it.
#pragma once

namespace fagen::ptx {

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256);
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256);
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace fagen::ptx
