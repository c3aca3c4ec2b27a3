// red.global.add.v4.f32 — four adjacent fp32 additions to global memory in one reduction (no
// return value). Minimum arch: sm_90 (PTX ISA 8.1: vector red on .global). The FA2 backward adds
// each lane's dQ fragment (16 bytes) with it, where sm_80 issues four atomicAdd.
// red.global.add.f32 — one fp32 addition, no return value (sm_20+): the FA4 backward's
// transposed dQ, a lane per head-dim column. atomicAdd with its result unused became an ATOMG
// (with a destination) on sm_100a, not the REDG this is (2026-12-05).
#pragma once

namespace fagen::ptx {

__device__ __forceinline__ void red_global_add_v4_f32(float* address, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(address), "f"(a), "f"(b), "f"(c),
                 "f"(d)
                 : "memory");
}

__device__ __forceinline__ void red_global_add_f32(float* address, float value) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(address), "f"(value) : "memory");
}

}  // namespace fagen::ptx
