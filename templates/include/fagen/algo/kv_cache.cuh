// Where one batch row's queries and cached keys are in the paged layout (FagenFwdParams' serving
// fields, fagen/contract.py: LAYOUTS): its lengths, its query tokens in dense or packed q / o,
// and its keys in a contiguous cache or in pages through a block table.
#pragma once
#include "fagen/params.h"

namespace fagen::algo {

struct Sequence {
    int seqlen_q;
    int seqlen_k;
    // The row of its first query token in q, o (and, packed, the LSE): cu_seqlens_q[batch], or 0
    // where q is dense (the batch stride then selects the row's block).
    int q_begin;
    // Its tokens' first index in the split-KV partial arrays (batch * seqlen_q + token dense,
    // the packed row packed): rows of the (batch * seqlen_q)-row partial layout.
    int partial_begin;

    static __device__ __forceinline__ Sequence of(const FagenFwdParams& p, int batch) {
        Sequence s;
        if (p.cu_seqlens_q != nullptr) {
            s.q_begin = p.cu_seqlens_q[batch];
            s.seqlen_q = p.cu_seqlens_q[batch + 1] - s.q_begin;
            s.partial_begin = s.q_begin;
        } else {
            s.q_begin = 0;
            s.seqlen_q = p.seqlen_q;
            s.partial_begin = batch * p.seqlen_q;
        }
        s.seqlen_k = p.seqused_k != nullptr ? min(p.seqused_k[batch], p.seqlen_k) : p.seqlen_k;
        return s;
    }
};

// Rows of a batch row's cached K (or V) from key `key` on: `base` is the tensor at the K/V head
// (k + kv_head * k_head_stride). A run of rows from `key` stays inside one page when it does not
// cross a multiple of page_size (the kernels' key blocks divide it). Returns null for a block
// table entry outside [0, pages), which the caller reads as zeros.
template <class Element>
__device__ __forceinline__ const Element* cache_rows(const FagenFwdParams& p, const Element* base,
                                                     long long batch_stride, long long row_stride,
                                                     int batch, int key) {
    if (p.block_table == nullptr) return base + batch * batch_stride + key * row_stride;
    const int page = p.block_table[batch * p.block_table_batch_stride + key / p.page_size];
    if (page < 0 || page >= p.pages) return nullptr;
    return base + page * batch_stride + (key % p.page_size) * row_stride;
}

}  // namespace fagen::algo
