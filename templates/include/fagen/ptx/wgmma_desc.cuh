// Shared-memory matrix descriptor of wgmma.mma_async (PTX ISA, "Matrix Descriptor Format").
// Not an instruction but the 64-bit operand those instructions read; built here, bit by bit.
// Minimum arch: sm_90a.
//
//   bits  0-13  start address >> 4           (shared-memory byte address of the first element)
//   bits 16-29  leading-dimension byte offset >> 4
//                 K-major + 128B swizzle: unused (one k16 step never leaves a 128-byte row);
//                 MN-major + 128B swizzle: bytes between consecutive 64-element MN chunks
//   bits 32-45  stride-dimension byte offset >> 4
//                 bytes between consecutive groups of 8 rows (K-major: 8 M/N rows; MN-major:
//                 8 K rows); 1024 for densely packed 128-byte rows
//   bits 49-51  matrix base offset: 0 — every operand tile starts 1024-byte aligned, so the
//               swizzle pattern starts at phase 0
//   bits 62-63  swizzle mode: 0 none, 1 = 128-byte, 2 = 64-byte, 3 = 32-byte
//
// The 128-byte swizzle is the one TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: within each
// 1024-byte block of 8 rows x 128 bytes, 16-byte chunk c of row r sits at chunk c ^ r.
#pragma once
#include "fagen/types.cuh"

namespace fagen::ptx {

constexpr unsigned long long kWgmmaSwizzle128B = 1;

__device__ __forceinline__ unsigned long long wgmma_desc_swizzle128(uint32_t smem_addr,
                                                                    uint32_t leading_bytes,
                                                                    uint32_t stride_bytes) {
    unsigned long long desc = 0;
    desc |= static_cast<unsigned long long>((smem_addr >> 4) & 0x3FFF);
    desc |= static_cast<unsigned long long>((leading_bytes >> 4) & 0x3FFF) << 16;
    desc |= static_cast<unsigned long long>((stride_bytes >> 4) & 0x3FFF) << 32;
    desc |= kWgmmaSwizzle128B << 62;
    return desc;
}

// `desc` with its start address moved `bytes` (a multiple of 16) further: a plain add to
// bits 0-13, exact while the address stays inside the 256 KB that field covers, which every
// shared-memory address does. Kernels build a descriptor per operand once and advance it per
// k-step and ring slot, instead of rebuilding all fields for each wgmma.
__device__ __forceinline__ unsigned long long wgmma_desc_advance(unsigned long long desc,
                                                                 uint32_t bytes) {
    return desc + (bytes >> 4);
}

}  // namespace fagen::ptx
