// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 — warp-wide tensor-core MMA.
// Minimum arch: sm_80 (bf16 needs sm_80; f16 exists from sm_75).
//
// Fragment ownership (lane = 4*group + quad, PTX ISA "Matrix Fragments for mma.m16n8k16"):
//   A (16x16, row-major): a[0] = A[group][2q..2q+1],   a[1] = A[group+8][2q..2q+1],
//                         a[2] = A[group][8+2q..+1],   a[3] = A[group+8][8+2q..+1]
//   B (16x8, column-major): b[0] = B[2q..2q+1][group], b[1] = B[8+2q..+1][group]
//   C/D (16x8, fp32): c[0..1] = C[group][2q..2q+1],    c[2..3] = C[group+8][2q..2q+1]
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

__device__ __forceinline__ void mma_sync_m16n8k16_f32_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_sync_m16n8k16_f32_f16(float (&d)[4], const uint32_t (&a)[4],
                                                          const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace fagen::ptx
