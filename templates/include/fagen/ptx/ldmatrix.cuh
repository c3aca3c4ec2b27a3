// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 — four 8x8 b16 matrices from shared memory
// into the mma.sync fragment layout. Minimum arch: sm_75.
//
// Lanes 8i..8i+7 give the shared-memory addresses of the 8 rows (16 bytes each) of matrix i;
// every lane receives one 32-bit register per matrix: without .trans, lane l gets elements
// (row l/4, columns 2(l%4)..+1); with .trans, the transpose (rows 2(l%4)..+1 of column l/4).
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

}  // namespace fagen::ptx
