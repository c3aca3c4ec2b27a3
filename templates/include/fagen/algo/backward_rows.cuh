// The two row kernels of every backward (fagen/contract.py, "Backward kernels"), shared by the
// FA2 and FA3 backward: before the main kernel, D = rowsum(dO * O) and LSE in base 2 per query
// row and dQ's fp32 accumulator zeroed; after it, dQ = softmax_scale * accumulator in the
// element type. kRowsPerCta rows per CTA, kRowThreads threads.
//
// The accumulator is laid out as the main kernel adds into it: row-major (FA3, whose
// tensor-map reduction adds whole rows), or in fragment tiles (FA2, kFragmentTiles): each
// 16 x 8 tile (rows 16R.., columns 8T..) is 128 consecutive floats in the order of an mma.sync
// C fragment (algo/fragment.cuh), lane by lane, so that a warp adds a whole tile with one
// 16-byte reduction per lane, 512 contiguous bytes. Tiles of a 16-row group follow each other
// by column; a head's rows are padded to 16 (varlen: each batch row's, algo/batch_row.cuh).
#pragma once
#include "fagen/algo/batch_row.cuh"
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/params.h"
#include "fagen/types.cuh"

namespace fagen::algo {

// kHeadDim: Q's and dQ's columns; kHeadDimV: O's and dO's.
template <class Element, int kHeadDim, int kHeadDimV, int kRowsPerCta, int kRowThreads, int kAccumRowAlign,
          bool kSinks, bool kFragmentTiles = false, bool kVarlen = false>
struct BackwardRows {
    using Ops = algo::ElementOps<Element>;
    using Row = BatchRow<kVarlen, kAccumRowAlign>;
    static_assert(!kFragmentTiles || (kHeadDim % 8 == 0 && kAccumRowAlign % 16 == 0));

    // The accumulator's first float of query head `head_of_batch` (batch * heads_q + head) of
    // batch row `seq`: its rows are padded to kAccumRowAlign (fagen/contract.py,
    // BackwardWorkspace). The dense layout's needs no batch index.
    static __device__ __forceinline__ long long accum_head(const FagenBwdParams& p, const Row& seq, int batch,
                                                           int head_of_batch) {
        if constexpr (kVarlen) return seq.accum_row(p, batch, head_of_batch - batch * p.heads_q) * kHeadDim;
        return head_of_batch * seq.accum_rows(p) * kHeadDim;
    }

    // The accumulator's offset of columns (2 pair, 2 pair + 1) of a head's row `row`.
    static __device__ __forceinline__ int accum_offset(int row, int pair) {
        if constexpr (!kFragmentTiles) return row * kHeadDim + 2 * pair;
        const int lane = 4 * (row % 8) + pair % 4;
        return (row / 16) * 16 * kHeadDim + (pair / 4) * 128 + 4 * lane + 2 * ((row / 8) % 2);
    }

    // ---------------------------------------------------------------- preprocess
    // D = rowsum(dO * O) on the tensor cores, as the main kernels' dP = dO V^T sums (an mma.sync
    // m16n8k16 per k16 step, k ascending from a zero accumulator, O in V's operand place): where
    // one key takes a whole row, O is that key's V row, and D and the key's dP are then the same
    // sum of the same products, equal to the bit, so that its dS = P (dP - D) is exactly 0. With
    // D summed on the CUDA cores in another order they differed in the last bit, which dQ / dK
    // multiply by |K| / |Q| (a randomised case with inputs x8 and outliers x100: dK 7x torch's
    // kernel's error; docs/performance.md, 2026-12-01). A warp per 16 rows: D of row r is the
    // diagonal of O (16 rows) times dO^T (two n8 tiles of its 16 rows); also the LSE in base 2
    // (algo/lse.cuh) and the rows of the dQ accumulator zeroed.
    static __device__ void preprocess(const FagenBwdParams& p) {
        static_assert(kHeadDimV % 16 == 0 && kRowsPerCta == 16 * (kRowThreads / 32), "a warp per 16 rows");
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        const Row seq = Row::of(p, batch);
        const int seqlen_q = seq.seqlen_q(p);
        const long long head_row0 = seq.row_array(p, batch, head);
        const int first = blockIdx.x * kRowsPerCta + 16 * warp;
        if (first >= seqlen_q) return;
        // The operand fragments' rows of this lane (algo/fragment.cuh): g and g + 8, columns 2t,
        // 2t + 1 and 2t + 8, 2t + 9 of each k16 step; rows past seqlen_q read as zeros.
        const int g = lane / 4, t = lane % 4;
        auto row_pairs = [&](const void* base, long long batch_stride, long long head_stride, long long row_stride,
                             int row) {
            return row < seqlen_q ? reinterpret_cast<const uint32_t*>(static_cast<const Element*>(base) +
                                                                      batch * batch_stride + head * head_stride +
                                                                      (seq.q_begin() + row) * row_stride)
                                  : nullptr;
        };
        const uint32_t* o_rows[2] = {row_pairs(p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride, first + g),
                                     row_pairs(p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride, first + g + 8)};
        const uint32_t* do_rows[2] = {
            row_pairs(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride, first + g),
            row_pairs(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride, first + g + 8)};
        auto pair_at = [](const uint32_t* row, int column) { return row != nullptr ? row[column / 2] : 0u; };
        float acc[2][4] = {};  // O times the first / second 8 rows of dO^T
#pragma unroll
        for (int kk = 0; kk < kHeadDimV / 16; ++kk) {
            const int column = 16 * kk + 2 * t;
            const uint32_t a[4] = {pair_at(o_rows[0], column), pair_at(o_rows[1], column),
                                   pair_at(o_rows[0], column + 8), pair_at(o_rows[1], column + 8)};
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const uint32_t b[2] = {pair_at(do_rows[n], column), pair_at(do_rows[n], column + 8)};
                Ops::mma(acc[n], a, b);
            }
        }
        // Row g's diagonal element is column g of the first tile, held by lane 4g + g/2 as its
        // element g % 2; row g + 8's is column g of the second tile, element 2 + g % 2 there.
        float sink_grad = 0.f;  // this lane's rows' part of dL/dsink
        if (t == g / 2) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = first + g + 8 * half;
                if (row >= seqlen_q) continue;
                const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin() + row];
                // Selected, not indexed by g: a run-time index puts acc in local memory (ptxas
                // for sm100a did, 2026-12-04).
                const float d = g % 2 ? acc[half][2 * half + 1] : acc[half][2 * half];
                p.softmax_d[head_row0 + row] = d;
                p.lse_log2[head_row0 + row] = algo::base2_lse(lse);
                // The sink's probability P_s = exp(sink - LSE) and its dP_s = dO . 0: its
                // gradient is P_s (0 - D), summed over the rows.
                if constexpr (kSinks) sink_grad -= ptx::ex2_approx_ftz(head_sink_log2(p, head) - algo::base2_lse(lse)) * d;
            }
        }
        if constexpr (kSinks) {
            // The warp's 16 rows in a fixed order (xor tree), one partial per 16 rows
            // (fagen/contract.py: BackwardWorkspace.sink_partials): convert_dq sums them.
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) sink_grad += __shfl_xor_sync(0xffffffffu, sink_grad, offset);
            if (lane == 0) p.sink_partials[(batch * p.heads_q + head) * sink_partials_per_head(p) + first / 16] = sink_grad;
        }
        float* accum = p.dq_accum + accum_head(p, seq, batch, batch * p.heads_q + head);
        for (int r = 0; r < 16 && first + r < seqlen_q; ++r) {
            for (int i = lane; i < kHeadDim / 2; i += 32) {
                *reinterpret_cast<float2*>(accum + accum_offset(first + r, i)) = make_float2(0.f, 0.f);
            }
        }
    }

    static __device__ __forceinline__ int sink_partials_per_head(const FagenBwdParams& p) {
        return (p.seqlen_q + 15) / 16;
    }

    // ---------------------------------------------------------------- dq
    // Also, with sinks, dL/dsink of each head: the first CTA of the head's rows in batch 0 sums
    // the preprocess's partials of every batch in a fixed order (deterministic in any mode);
    // varlen: of each batch row's own rows.
    static __device__ void convert_dq(const FagenBwdParams& p) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int head = blockIdx.y, batch = blockIdx.z;
        if constexpr (kSinks) {
            if (blockIdx.x == 0 && batch == 0 && warp == 0) {
                const int per_head = sink_partials_per_head(p);
                float sum = 0.f;
                for (int b = 0; b < p.batch; ++b) {
                    const float* partials = p.sink_partials + (b * p.heads_q + head) * per_head;
                    const int written = kVarlen ? (Row::of(p, b).seqlen_q(p) + 15) / 16 : per_head;
                    for (int i = lane; i < written; i += 32) sum += partials[i];
                }
#pragma unroll
                for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
                if (lane == 0) p.dsinks[head] = sum;
            }
        }
        const Row seq = Row::of(p, batch);
        for (int r = warp; r < kRowsPerCta; r += kRowThreads / 32) {
            const int row = blockIdx.x * kRowsPerCta + r;
            if (row >= seq.seqlen_q(p)) break;
            const float* accum = p.dq_accum + accum_head(p, seq, batch, batch * p.heads_q + head);
            Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride +
                          head * p.dq_head_stride + (seq.q_begin() + row) * p.dq_row_stride;
            for (int i = lane; i < kHeadDim / 2; i += 32) {
                const float2 g = *reinterpret_cast<const float2*>(accum + accum_offset(row, i));
                reinterpret_cast<uint32_t*>(dq)[i] = Ops::pack(g.x * p.softmax_scale, g.y * p.softmax_scale);
            }
        }
    }
};

}  // namespace fagen::algo
