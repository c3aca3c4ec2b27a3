// red.global.add.v2.f32 — two adjacent fp32 additions to global memory in one reduction (no
// return value). Minimum arch: sm_90 (PTX ISA 8.1: vector red on .global). The backward adds
// dQ in pairs of columns with it, where sm_80 issues two atomicAdd.
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ void red_global_add_v2_f32(float* address, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
}

}  // namespace fagen::ptx
