// Where one batch row's queries and cached keys are in the paged layout (FagenFwdParams' serving
// fields, fagen/contract.py: LAYOUTS): its lengths, its query tokens in dense or packed q / o,
// and its keys in a contiguous cache or in pages through a block table.
#pragma once
#include "fagen/algo/companion_row.cuh"
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
        // seqused_k holds the lengths before this call's append (FagenFwdParams: seqlen_new).
        s.seqlen_k = p.seqused_k != nullptr ? min(p.seqused_k[batch] + p.seqlen_new, p.seqlen_k) : p.seqlen_k;
        return s;
    }
};

// The page of batch row `batch` that holds key `key` (its block table entry; key below the
// row's capacity), or -1 for an entry outside [0, pages).
__device__ __forceinline__ int cache_page(const FagenFwdParams& p, int batch, int key) {
    const int page = p.block_table[batch * p.block_table_batch_stride + key / p.page_size];
    return page < 0 || page >= p.pages ? -1 : page;
}

// Rows of a batch row's cached K (or V) from key `key` on, in `page` (cache_page's; ignored
// without a block table): `base` is the tensor at the K/V head (k + kv_head * k_head_stride). A
// run of rows from `key` stays inside one page when it does not cross a multiple of page_size
// (the kernels' runs of keys divide it). Returns null for page -1, which the caller reads as
// zeros.
template <class Element>
__device__ __forceinline__ const Element* page_rows(const FagenFwdParams& p, const Element* base,
                                                    long long batch_stride, long long row_stride, int batch,
                                                    int page, int key) {
    if (p.block_table == nullptr) return base + batch * batch_stride + key * row_stride;
    if (page < 0) return nullptr;
    return base + page * batch_stride + (key % p.page_size) * row_stride;
}

// The same, looking the page up.
template <class Element>
__device__ __forceinline__ const Element* cache_rows(const FagenFwdParams& p, const Element* base,
                                                     long long batch_stride, long long row_stride,
                                                     int batch, int key) {
    return page_rows(p, base, batch_stride, row_stride, batch,
                     p.block_table == nullptr ? 0 : cache_page(p, batch, key), key);
}

// The append entry point (fagen/contract.py: SPLIT_APPEND_SUFFIX): row `token` of k_new and v_new
// into the cache at key seqused_k[batch] + token, a warp per (batch row, new token, KV head),
// `rows_per_cta` of them per CTA, KV heads innermost (one row's heads are one contiguous run of
// the cache). Nothing is written for a key at or past seqlen_k (the row's capacity) or through a
// block table entry outside [0, pages): the host cannot see the lengths, and no write may land
// outside the cache.
// The new rows are in the cache's element type (an e4m3 cache takes e4m3 rows, as flash-attn's).
template <class Element, int kHeadDim, int kHeadDimV>
__device__ __forceinline__ void append_rows(const FagenFwdParams& p, int rows_per_cta) {
    constexpr int kVecElements = 16 / static_cast<int>(sizeof(Element));
    static_assert(kHeadDim % kVecElements == 0 && kHeadDimV % kVecElements == 0, "rows move as 16-byte vectors");
    const int lane = threadIdx.x % 32;
    CompanionRow row;
    if (!CompanionRow::of(rows_per_cta, p.batch, p.seqlen_new, p.heads_kv, row)) return;
    const int batch = row.batch, token = row.token, head = row.head;
    const int key = p.seqused_k[batch] + token;
    if (key < 0 || key >= p.seqlen_k) return;
    auto copy = [&](const void* from, long long from_batch, long long from_row, long long from_head, const void* cache,
                    long long batch_stride, long long row_stride, long long head_stride, int columns) {
        const Element* source = static_cast<const Element*>(from) + batch * from_batch + token * from_row +
                                head * from_head;
        const Element* target = cache_rows(p, static_cast<const Element*>(cache) + head * head_stride, batch_stride,
                                           row_stride, batch, key);
        if (target == nullptr) return;
        for (int c = kVecElements * lane; c < columns; c += kVecElements * 32) {
            *reinterpret_cast<uint4*>(const_cast<Element*>(target) + c) = *reinterpret_cast<const uint4*>(source + c);
        }
    };
    copy(p.k_new, p.k_new_batch_stride, p.k_new_row_stride, p.k_new_head_stride, p.k, p.k_batch_stride,
         p.k_row_stride, p.k_head_stride, kHeadDim);
    copy(p.v_new, p.v_new_batch_stride, p.v_new_row_stride, p.v_new_head_stride, p.v, p.v_batch_stride,
         p.v_row_stride, p.v_head_stride, kHeadDimV);
}

}  // namespace fagen::algo
