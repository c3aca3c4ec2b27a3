// tcgen05.ld / tcgen05.st .sync.aligned.32x32b.x16.b32 and tcgen05.wait::ld / wait::st —
// moves between Tensor Memory and registers. Minimum arch: sm_100a.
//
// Shape 32x32b: the warp covers 32 consecutive TMEM lanes, lane i of the access belonging to
// thread i; .x16 repeats it over 16 consecutive columns, so each thread moves 16 32-bit cells of
// one lane (one matrix row). A warp may only touch the 32-lane quarter (warp id % 4) of TMEM:
// `taddr` must name that quarter's first lane (bits 31-16) and the first column (bits 15-0).
//
// Loads and stores are asynchronous: registers written by tcgen05.ld are valid only after
// tcgen05_wait_ld(), and TMEM written by tcgen05.st is visible to the tensor core only after
// tcgen05_wait_st() (plus the fences of tcgen05_fence.cuh around the hand-off).
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

__device__ __forceinline__ void tcgen05_ld_32x32b_x16(uint32_t taddr, uint32_t (&v)[16]) {
    asm volatile(
        "tcgen05.ld.sync.aligned.32x32b.x16.b32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, [%16];\n"
        : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]), "=r"(v[6]),
          "=r"(v[7]), "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]), "=r"(v[12]),
          "=r"(v[13]), "=r"(v[14]), "=r"(v[15])
        : "r"(taddr));
}

__device__ __forceinline__ void tcgen05_st_32x32b_x16(uint32_t taddr, const uint32_t (&v)[16]) {
    asm volatile(
        "tcgen05.st.sync.aligned.32x32b.x16.b32 "
        "[%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16};\n"
        :
        : "r"(taddr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(v[4]), "r"(v[5]),
          "r"(v[6]), "r"(v[7]), "r"(v[8]), "r"(v[9]), "r"(v[10]), "r"(v[11]), "r"(v[12]),
          "r"(v[13]), "r"(v[14]), "r"(v[15])
        : "memory");
}

// Blocks until every tcgen05.ld this thread issued has written its registers.
__device__ __forceinline__ void tcgen05_wait_ld() {
    asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
}

// Blocks until every tcgen05.st this thread issued has landed in Tensor Memory.
__device__ __forceinline__ void tcgen05_wait_st() {
    asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
}

// After tcgen05_wait_ld(): ties the loaded registers to this point, so the compiler cannot move
// their first use above the wait (it sees them written by the tcgen05.ld asm already).
__device__ __forceinline__ void tcgen05_ld_fence_registers(uint32_t (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(v[i])::"memory");
}

}  // namespace fagen::ptx
