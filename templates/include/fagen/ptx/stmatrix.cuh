// stmatrix.sync.aligned.m8n8.x4.shared.b16 — four 8x8 b16 matrices from registers into shared
// memory, ldmatrix's inverse. Minimum arch: sm_90.
//
// Lanes 8i..8i+7 give the shared-memory addresses of the 8 rows (16 bytes each) of matrix i;
// lane l's register i is written to matrix i's row l/4, bytes 4(l%4)..+3.
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

}  // namespace fagen::ptx
