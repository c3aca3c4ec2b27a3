// Where a (query block, head, batch) tile's output goes, and the output of a tile that sees no
// key at all. Shared by every forward kernel (FA2, FA3, FA4).
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/params.h"

namespace fagen::algo {

// The tile's first output row: O[batch, row_begin, head, 0].
template <class Element>
__device__ __forceinline__ Element* tile_output(const FagenFwdParams& p, int batch, int head,
                                                int row_begin) {
    return static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
           row_begin * p.o_row_stride;
}

// The tile's first LSE entry, or nullptr when the caller asked for no LSE.
__device__ __forceinline__ float* tile_lse(const FagenFwdParams& p, int batch, int head,
                                           int row_begin) {
    return p.lse == nullptr
               ? nullptr
               : p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + row_begin;
}

// Query rows that see no key at all (causal with seqlen_q > seqlen_k): O = 0, LSE = `empty_lse`
// (-inf; with a sink, the sink's logit, the row's only term), for the first `rows_valid` of kRows
// rows, written by kThreads threads (`thread` in [0, kThreads)).
template <class Element, int kRows, int kHeadDim, int kThreads>
__device__ void write_empty_rows(Element* o, long long o_row_stride, float* lse,
                                 int rows_valid, int thread, float empty_lse = neg_inf()) {
    constexpr int kVecsPerRow = kHeadDim / 8;  // 16-byte vectors
    for (int idx = thread; idx < kRows * kVecsPerRow; idx += kThreads) {
        const int row = idx / kVecsPerRow;
        if (row < rows_valid) {
            *reinterpret_cast<uint4*>(o + row * o_row_stride + (idx % kVecsPerRow) * 8) =
                make_uint4(0, 0, 0, 0);
        }
    }
    if (lse != nullptr) {
        for (int row = thread; row < kRows && row < rows_valid; row += kThreads) {
            lse[row] = empty_lse;
        }
    }
}

}  // namespace fagen::algo
