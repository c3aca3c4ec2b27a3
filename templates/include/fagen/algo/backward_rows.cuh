// The two row kernels of every backward (fagen/contract.py, "Backward kernels"), shared by the
// FA2 and FA3 backward: before the main kernel, D = rowsum(dO * O) and LSE in base 2 per query
// row and dQ's fp32 accumulator zeroed; after it, dQ = softmax_scale * accumulator in the
// element type. A warp per row; kRowsPerCta rows per CTA, kRowThreads threads.
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/fa2/element.cuh"
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::algo {

template <class Element, int kHeadDim, int kRowsPerCta, int kRowThreads>
struct BackwardRows {
    using Ops = fa2::ElementOps<Element>;

    // ---------------------------------------------------------------- preprocess
    // Warp per row: D = rowsum(dO * O), LSE * log2(e), dQ accumulator row = 0.
    static __device__ void preprocess(const FagenBwdParams& p) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        constexpr int kVecs = kHeadDim / 8;  // 16-byte vectors per row
        constexpr float kLog2e = 1.4426950408889634f;
        const long long head_row0 = (static_cast<long long>(batch) * p.heads_q + head) * p.seqlen_q;
        for (int r = warp; r < kRowsPerCta; r += kRowThreads / 32) {
            const int row = blockIdx.x * kRowsPerCta + r;
            if (row >= p.seqlen_q) break;
            const Element* o = static_cast<const Element*>(p.o) + batch * p.o_batch_stride +
                               head * p.o_head_stride + row * p.o_row_stride;
            const Element* dout = static_cast<const Element*>(p.dout) + batch * p.do_batch_stride +
                                  head * p.do_head_stride + row * p.do_row_stride;
            float sum = 0.f;
            for (int vec = lane; vec < kVecs; vec += 32) {
                const uint4 ov = *reinterpret_cast<const uint4*>(o + vec * 8);
                const uint4 dv = *reinterpret_cast<const uint4*>(dout + vec * 8);
                sum += fa2::dot8<Element>(ov, dv);
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            float* accum = p.dq_accum + (head_row0 + row) * kHeadDim;
            for (int i = lane; i < kHeadDim / 4; i += 32) {
                reinterpret_cast<float4*>(accum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
            if (lane == 0) {
                const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row];
                p.softmax_d[head_row0 + row] = sum;
                p.lse_log2[head_row0 + row] = lse == algo::neg_inf() ? -algo::neg_inf() : lse * kLog2e;
            }
        }
    }

    // ---------------------------------------------------------------- dq
    static __device__ void convert_dq(const FagenBwdParams& p) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        const long long head_row0 = (static_cast<long long>(batch) * p.heads_q + head) * p.seqlen_q;
        for (int r = warp; r < kRowsPerCta; r += kRowThreads / 32) {
            const int row = blockIdx.x * kRowsPerCta + r;
            if (row >= p.seqlen_q) break;
            const float* accum = p.dq_accum + (head_row0 + row) * kHeadDim;
            Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride +
                          head * p.dq_head_stride + row * p.dq_row_stride;
            for (int i = lane; i < kHeadDim / 2; i += 32) {
                const float2 g = reinterpret_cast<const float2*>(accum)[i];
                reinterpret_cast<uint32_t*>(dq)[i] = Ops::pack(g.x * p.softmax_scale, g.y * p.softmax_scale);
            }
        }
    }
};

}  // namespace fagen::algo
