// The two row kernels of every backward (fagen/contract.py, "Backward kernels"), shared by the
// FA2 and FA3 backward: before the main kernel, D = rowsum(dO * O) and LSE in base 2 per query
// row and dQ's fp32 accumulator zeroed; after it, dQ = softmax_scale * accumulator in the
// element type. A warp per row; kRowsPerCta rows per CTA, kRowThreads threads.
//
// The accumulator is laid out as the main kernel adds into it: row-major (FA3, whose
// tensor-map reduction adds whole rows), or in fragment tiles (FA2, kFragmentTiles): each
// 16 x 8 tile (rows 16R.., columns 8T..) is 128 consecutive floats in the order of an mma.sync
// C fragment (algo/fragment.cuh), lane by lane, so that a warp adds a whole tile with one
// 16-byte reduction per lane, 512 contiguous bytes. Tiles of a 16-row group follow each other
// by column; a head's rows are padded to 16.
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/fa2/element.cuh"
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::algo {

template <class Element, int kHeadDim, int kRowsPerCta, int kRowThreads, int kAccumRowAlign,
          bool kFragmentTiles = false>
struct BackwardRows {
    using Ops = fa2::ElementOps<Element>;
    static_assert(!kFragmentTiles || (kHeadDim % 8 == 0 && kAccumRowAlign % 16 == 0));

    // The accumulator's first float of query head `head_of_batch` (batch * heads_q + head): its
    // rows are padded to kAccumRowAlign (fagen/contract.py, BackwardWorkspace).
    static __device__ __forceinline__ long long accum_head(const FagenBwdParams& p, int head_of_batch) {
        const long long rows = (p.seqlen_q + kAccumRowAlign - 1) / kAccumRowAlign * kAccumRowAlign;
        return head_of_batch * rows * kHeadDim;
    }

    // The accumulator's offset of columns (2 pair, 2 pair + 1) of a head's row `row`.
    static __device__ __forceinline__ int accum_offset(int row, int pair) {
        if constexpr (!kFragmentTiles) return row * kHeadDim + 2 * pair;
        const int lane = 4 * (row % 8) + pair % 4;
        return (row / 16) * 16 * kHeadDim + (pair / 4) * 128 + 4 * lane + 2 * ((row / 8) % 2);
    }

    // ---------------------------------------------------------------- preprocess
    // Warp per row: D = rowsum(dO * O), the LSE in base 2 (algo/lse.cuh), dQ accumulator row = 0.
    static __device__ void preprocess(const FagenBwdParams& p) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        constexpr int kVecs = kHeadDim / 8;  // 16-byte vectors per row
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
            float* accum = p.dq_accum + accum_head(p, batch * p.heads_q + head);
            for (int i = lane; i < kHeadDim / 2; i += 32) {
                *reinterpret_cast<float2*>(accum + accum_offset(row, i)) = make_float2(0.f, 0.f);
            }
            if (lane == 0) {
                const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row];
                p.softmax_d[head_row0 + row] = sum;
                p.lse_log2[head_row0 + row] = algo::base2_lse(lse);
            }
        }
    }

    // ---------------------------------------------------------------- dq
    static __device__ void convert_dq(const FagenBwdParams& p) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        for (int r = warp; r < kRowsPerCta; r += kRowThreads / 32) {
            const int row = blockIdx.x * kRowsPerCta + r;
            if (row >= p.seqlen_q) break;
            const float* accum = p.dq_accum + accum_head(p, batch * p.heads_q + head);
            Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride +
                          head * p.dq_head_stride + row * p.dq_row_stride;
            for (int i = lane; i < kHeadDim / 2; i += 32) {
                const float2 g = *reinterpret_cast<const float2*>(accum + accum_offset(row, i));
                reinterpret_cast<uint32_t*>(dq)[i] = Ops::pack(g.x * p.softmax_scale, g.y * p.softmax_scale);
            }
        }
    }
};

}  // namespace fagen::algo
