// tcgen05.mma.cta_group::1.kind::f16 and .kind::f8f6f4 (e4m3 operands) — one thread issues D
// (TMEM, fp32) (+)= A * B on the 5th generation tensor core, with B in shared memory and A in
// shared memory (_ss) or in Tensor Memory (_ts). Minimum arch: sm_100a.
//
// The MMA is asynchronous: completion is observed through tcgen05_commit (tcgen05_commit.cuh).
// MMAs issued by one thread execute in issue order, so an MMA may overwrite TMEM that an
// earlier MMA of the same thread reads without any wait in between.
//
// With M = 128 and cta_group::1, row i of D (and of a TMEM A operand) is TMEM lane i; column j
// of fp32 D is TMEM column j; a 16-bit A in TMEM packs elements (2c, 2c+1) of a row into column
// c (an 8-bit A four, (4c .. 4c+3)). K is 16 per instruction for 16-bit inputs, 32 for 8-bit.
#pragma once
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/types.cuh"

namespace fagen::ptx {

// ---------------------------------------------------------------- shared-memory descriptor
// 64-bit descriptor of an operand tile in shared memory (PTX ISA, "Shared memory descriptor" of
// tcgen05), for K-major or MN-major tiles in the 128-byte swizzle TMA writes
// (CU_TENSOR_MAP_SWIZZLE_128B: 16-byte chunk c of row r of each 8-row x 128-byte block sits at
// chunk c ^ (r % 8)).
//
//   bits  0-13  start address >> 4        shared-memory byte address of the first element
//   bits 14-15  0                         reserved
//   bits 16-29  leading byte offset >> 4  K-major + swizzle: unused (an MMA's 16 K never leave
//                                         a 128-byte row); MN-major: bytes between consecutive
//                                         64-element chunks of the MN dimension
//   bits 30-31  0                         reserved
//   bits 32-45  stride byte offset >> 4   bytes between consecutive 8-row groups (1024 for
//                                         dense 128-byte rows)
//   bits 46-48  0b001                     descriptor version, fixed for tcgen05
//   bits 49-51  base offset 0             every tile starts 1024-byte aligned, so the swizzle
//                                         pattern starts at phase 0
//   bit  52     0                         leading byte offset is relative, not absolute
//   bits 53-60  0                         reserved
//   bits 61-63  2                         swizzle mode 128-byte (0 none, 1 128-byte with 32-byte
//                                         atoms, 4 64-byte, 6 32-byte)
constexpr unsigned long long kTcgen05DescriptorVersion = 1;
constexpr unsigned long long kTcgen05Swizzle128B = 2;

// Bits 0-45 are laid out as in wgmma's descriptor (wgmma_desc.cuh), and the 128-byte swizzle is
// the same bit (mode 2 in bits 61-63 is wgmma's mode 1 in bits 62-63): only the version differs.
static_assert(kTcgen05Swizzle128B << 61 == kWgmmaSwizzle128B << 62);

__device__ __forceinline__ unsigned long long tcgen05_smem_desc_swizzle128(uint32_t smem_addr,
                                                                          uint32_t leading_bytes,
                                                                          uint32_t stride_bytes) {
    return wgmma_desc_swizzle128(smem_addr, leading_bytes, stride_bytes) |
           kTcgen05DescriptorVersion << 46;
}

// ---------------------------------------------------------------- instruction descriptor
// 32-bit instruction descriptor of kind::f16 (PTX ISA, "Instruction descriptor"), a compile-time
// constant of the variant:
//
//   bits  0-1   sparsity selector 0       dense MMA: unused
//   bit   2     sparsity 0                dense
//   bit   3     saturate 0                integer kinds only
//   bits  4-5   D type 1                  fp32 accumulator (0 would be fp16)
//   bit   6     0                         reserved
//   bits  7-9   A type                    0 fp16, 1 bf16
//   bits 10-12  B type                    0 fp16, 1 bf16 (always equal to A here)
//   bit  13     negate A 0
//   bit  14     negate B 0
//   bit  15     transpose A               0 K-major (Q rows; P rows in TMEM), 1 MN-major (the
//                                         backward's dS read from its dS^T tile)
//   bit  16     transpose B               0 K-major (K of Q K^T), 1 MN-major (V of P V)
//   bits 17-22  N >> 3                    columns of D
//   bit  23     0                         reserved
//   bits 24-28  M >> 4                    rows of D
//   bit  29     0                         reserved
//   bits 30-31  max shift 0               .ws variants only
template <int kM, int kN, bool kBf16, bool kTransposeB, bool kTransposeA = false>
struct Tcgen05F16InstructionDescriptor {
    static_assert(kM == 64 || kM == 128, "cta_group::1 kind::f16 has M = 64 or 128");
    static_assert(kN % (kM == 64 ? 8 : 16) == 0 && kN >= 16 && kN <= 256,
                  "N must be a multiple of 16 (M = 128) or 8 (M = 64) in [16, 256]");
    static constexpr uint32_t kDTypeF32 = 1;
    static constexpr uint32_t kInputType = kBf16 ? 1 : 0;
    static constexpr uint32_t value = (kDTypeF32 << 4) | (kInputType << 7) | (kInputType << 10) |
                                      ((kTransposeA ? 1u : 0u) << 15) | ((kTransposeB ? 1u : 0u) << 16) |
                                      (static_cast<uint32_t>(kN >> 3) << 17) |
                                      (static_cast<uint32_t>(kM >> 4) << 24);
};

// The 32-bit instruction descriptor of kind::f8f6f4 with both operands e4m3 (the fields as
// above; A and B type 0 = E4M3 in this kind's encoding: 1 E5M2, 3 E2M3, 4 E3M2, 5 E2M1). K is
// 32 per instruction for 8-bit inputs.
template <int kM, int kN, bool kTransposeB>
struct Tcgen05E4m3InstructionDescriptor {
    static_assert(kM == 128, "the FA4 kernels use M = 128");
    static_assert(kN % 16 == 0 && kN >= 16 && kN <= 256, "N must be a multiple of 16 in [16, 256]");
    static constexpr uint32_t kDTypeF32 = 1;
    static constexpr uint32_t kE4m3 = 0;
    static constexpr uint32_t value = (kDTypeF32 << 4) | (kE4m3 << 7) | (kE4m3 << 10) |
                                      ((kTransposeB ? 1u : 0u) << 16) |
                                      (static_cast<uint32_t>(kN >> 3) << 17) |
                                      (static_cast<uint32_t>(kM >> 4) << 24);
};

// ---------------------------------------------------------------- the MMAs
// D[tmem_d] = A * B (accumulate = 0) or D += A * B (accumulate != 0); A and B by descriptor.
__device__ __forceinline__ void tcgen05_mma_f16_ss(uint32_t tmem_d, unsigned long long desc_a,
                                                   unsigned long long desc_b,
                                                   uint32_t instruction_desc, uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n"
        "}\n"
        :
        : "r"(tmem_d), "l"(desc_a), "l"(desc_b), "r"(instruction_desc), "r"(accumulate)
        : "memory");
}

// As above with A (M rows x 16 K, 16-bit, two per column) read from Tensor Memory at tmem_a.
__device__ __forceinline__ void tcgen05_mma_f16_ts(uint32_t tmem_d, uint32_t tmem_a,
                                                   unsigned long long desc_b,
                                                   uint32_t instruction_desc, uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], [%1], %2, %3, p;\n"
        "}\n"
        :
        : "r"(tmem_d), "r"(tmem_a), "l"(desc_b), "r"(instruction_desc), "r"(accumulate)
        : "memory");
}

// tcgen05.mma.cta_group::1.kind::f8f6f4 with e4m3 operands (Tcgen05E4m3InstructionDescriptor):
// as tcgen05_mma_f16_ss / _ts, K = 32 per instruction (a 16-bit A's 16 K are 8 TMEM columns, an
// 8-bit A's 32 K too: four values per column).
__device__ __forceinline__ void tcgen05_mma_f8f6f4_ss(uint32_t tmem_d, unsigned long long desc_a,
                                                      unsigned long long desc_b, uint32_t instruction_desc,
                                                      uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f8f6f4 [%0], %1, %2, %3, p;\n"
        "}\n"
        :
        : "r"(tmem_d), "l"(desc_a), "l"(desc_b), "r"(instruction_desc), "r"(accumulate)
        : "memory");
}

__device__ __forceinline__ void tcgen05_mma_f8f6f4_ts(uint32_t tmem_d, uint32_t tmem_a, unsigned long long desc_b,
                                                      uint32_t instruction_desc, uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f8f6f4 [%0], [%1], %2, %3, p;\n"
        "}\n"
        :
        : "r"(tmem_d), "r"(tmem_a), "l"(desc_b), "r"(instruction_desc), "r"(accumulate)
        : "memory");
}

}  // namespace fagen::ptx
