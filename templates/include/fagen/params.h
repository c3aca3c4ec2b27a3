// fagen kernel ABI: the one parameter every forward kernel (FagenFwdParams) or backward kernel
// (FagenBwdParams) takes, by value, as a `const __grid_constant__` struct. Plain C so that host code in C, C++ and Python (ctypes,
// fagen/abi.py) can fill it. Bump FAGEN_ABI_VERSION on any change of layout or meaning; the
// loaders refuse a bundle built against another version. Every kernel re-checks the offsets the
// Python side computed with static_assert, so the two layouts cannot drift apart silently.
#pragma once

// 2: FagenBwdParams.dq_accum's rows padded per (batch, head).
// 3: window_left, window_right.
// 4: the score modifiers (softcap_scale, alibi_slopes, alibi_batch_stride, sinks; dsinks,
//    sink_partials).
// 5: mask_args (a custom mask's arguments).
// 6: the serving fields of FagenFwdParams (cu_seqlens_q ... lse_partial).
// 7: cu_seqlens_k (FagenFwdParams), cu_seqlens_q, cu_seqlens_k and total_q (FagenBwdParams):
//    the varlen layout.
// 8: k_new, v_new, their strides and seqlen_new (a KV-cache call's append); FagenMergeParams.
// 9: q_descale, k_descale, v_descale and their strides (the e4m3 element's descales).
#define FAGEN_ABI_VERSION 9

#ifdef __cplusplus
extern "C" {
#endif

typedef struct FagenFwdParams {
    // Tensors in flash-attn layout (batch, seqlen, heads, head_dim); the last dimension must be
    // contiguous and every row start 16-byte aligned (the kernels move 16-byte vectors).
    const void* q;
    const void* k;
    const void* v;
    void* o;
    // Log-sum-exp of each query row, natural log, (batch, heads_q, seqlen_q) fp32; may be null.
    float* lse;

    // Strides in elements (not bytes).
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;

    int batch;
    int heads_q;
    int heads_kv;   // heads_q is a multiple of heads_kv (GQA/MQA)
    int seqlen_q;
    int seqlen_k;

    // softmax_scale * log2(e): the kernels work in base 2 with the scale folded in.
    float scale_log2;
    // The band of keys a query row sees under a local mask (algo/mask.cuh): row i sees keys
    // [i + seqlen_k - seqlen_q - window_left, i + seqlen_k - seqlen_q + window_right]; both >= 0,
    // an unbounded edge as seqlen_q + seqlen_k (fagen/contract.py: call_mask). Other masks
    // ignore them.
    int window_left;
    int window_right;
    // The score modifiers (algo/score.cuh), read only by kernels built with them: softcap:
    // softmax_scale / softcap (scale_log2 is then softcap * log2(e)); ALiBi: fp32 slopes of
    // (batch, heads_q) with alibi_batch_stride = heads_q, or of (heads_q,) with stride 0;
    // sinks: one fp32 logit per query head (heads_q,), in the units of the scaled scores.
    float softcap_scale;
    const float* alibi_slopes;
    long long alibi_batch_stride;
    const float* sinks;
    // A custom mask's arguments (algo/mask.cuh, CustomMask): device memory its user type reads
    // (e.g. each token's document id), read only by kernels built with a custom mask.
    const void* mask_args;

    // Serving (read only by kernels of the paged layout; fagen/contract.py: LAYOUTS).
    // cu_seqlens_q: (batch + 1) int32 offsets of each batch row's query tokens in q and o, which
    // are then packed (q_batch_stride = o_batch_stride = lse_batch_stride = 0, seqlen_q the
    // longest row, the LSE (heads_q, total tokens)); null: every batch row has seqlen_q tokens.
    // seqused_k: (batch,) int32 keys of each batch row (a KV cache's lengths, each <=
    // seqlen_k); null: seqlen_k each.
    const int* cu_seqlens_q;
    const int* seqused_k;
    // block_table: (batch, ...) int32 page indices into k and v, whose batch dimension is then
    // the page ((pages, page_size, heads_kv, head_dim)): key j of batch row b is row j % page_size
    // of page block_table[b * block_table_batch_stride + j / page_size]; an entry outside
    // [0, pages) reads as keys and values of zeros, never out of bounds. null: k and v hold each
    // batch row's keys contiguously (a contiguous KV cache).
    const int* block_table;
    long long block_table_batch_stride;
    int page_size;
    int pages;
    // Split-KV: num_splits CTAs share the keys of one (batch row, KV head, query block), each
    // writing its normalised partial O and its LSE (natural log, -inf where it saw no key); the
    // kernel's combine entry point merges them into o and lse. 1: the kernel writes o and lse.
    int num_splits;
    float* o_partial;    // (num_splits, batch * seqlen_q, heads_q, head_dim_v) fp32
    float* lse_partial;  // (num_splits, heads_q, batch * seqlen_q) fp32

    // The varlen layout (read only by its kernels; algo/batch_row.cuh): with cu_seqlens_q above,
    // cu_seqlens_k, (batch + 1) int32 offsets of each batch row's keys in k and v, which are then
    // packed like q ((total_k, heads_kv, head_dim), batch strides 0); seqlen_q and seqlen_k are
    // the longest rows' (they size the grid), seqused_k (if not null) caps each row's keys.
    const int* cu_seqlens_k;

    // A KV-cache call's new keys and values (read only by the paged-layout kernels' append entry
    // point, fagen/contract.py: SPLIT_APPEND_SUFFIX): (batch, seqlen_new, heads_kv, head_dim)
    // like the cache rows, written into the cache at keys seqused_k[b], seqused_k[b] + 1, ...
    // (through the block table), skipping a key at or past seqlen_k and a page outside [0,
    // pages). The attention kernel then sees min(seqused_k[b] + seqlen_new, seqlen_k) keys per
    // row: seqused_k stays the lengths before the append (flash-attn's cache_seqlens).
    // seqlen_new 0: no append.
    const void* k_new;
    const void* v_new;
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    int seqlen_new;
    // e4m3 kernels: fp32 factors that turn the stored elements back into the values they stand
    // for, one per (batch, kv head) at [b * batch_stride + h * head_stride] (strides 0: one value
    // broadcast; flash-attn's q_descale, k_descale, v_descale); null: 1. Scores are q_descale *
    // k_descale * (Q K^T of the stored elements), O is v_descale * (P V). Other kernels ignore them.
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
    long long q_descale_batch_stride, q_descale_head_stride;
    long long k_descale_batch_stride, k_descale_head_stride;
    long long v_descale_batch_stride, v_descale_head_stride;
} FagenFwdParams;

// The parameter of every backward kernel (preprocess, main, dQ conversion), by value like
// FagenFwdParams. Tensors in flash-attn layout; dq/dk/dv like q/k/v (dk, dv with heads_kv heads).
// The fp32 workspace arrays are (batch, heads_q, seqlen_q) contiguous, dq_accum's rows padded
// to FAGEN_DQ_ACCUM_ROW_ALIGN per (batch, head); the caller allocates them (fagen/contract.py:
// BackwardWorkspace) and the preprocess kernel fills them.
typedef struct FagenBwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;   // (batch, heads_q, seqlen_q), natural log, from the forward
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;    // head_dim floats per query row: dQ / softmax_scale, accumulated (in the
                        // order of the kernel's algo::BackwardRows)
    float* softmax_d;   // per query row: rowsum(dO * O)
    float* lse_log2;    // per query row: LSE * log2(e), +inf for a row that saw no key
    // Deterministic mode: one counter per (batch, head_q, query block of the main kernel),
    // zeroed by the caller; null: dQ accumulates with atomics in any order.
    int* dq_semaphore;

    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long lse_batch_stride, lse_head_stride;

    int batch;
    int heads_q;
    int heads_kv;
    int seqlen_q;
    int seqlen_k;

    float scale_log2;     // as in FagenFwdParams
    int window_left;      // as in FagenFwdParams
    int window_right;
    float softcap_scale;  // the score modifiers, as in FagenFwdParams
    const float* alibi_slopes;
    long long alibi_batch_stride;
    const float* sinks;
    const void* mask_args;  // as in FagenFwdParams
    float softmax_scale;  // dQ and dK are softmax_scale * (dS K), softmax_scale * (dS^T Q)
    // Sinks only: dL/dsink per query head (heads_q,) fp32, written by the dQ conversion from the
    // workspace's per-16-row partials (fagen/contract.py: BackwardWorkspace.sink_partials).
    float* dsinks;
    float* sink_partials;
    // The varlen layout, as in FagenFwdParams: q, o, dout, dq packed by cu_seqlens_q, k, v, dk,
    // dv by cu_seqlens_k, the LSE (heads_q, total_q); the workspace then holds the packed rows
    // (fagen/contract.py: BackwardWorkspace.varlen). total_q: q's rows (its first dimension).
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;
} FagenBwdParams;

// The parameter of the paged-layout kernels' merge entry point (fagen/contract.py:
// SPLIT_MERGE_SUFFIX): the attention over two disjoint key sets from each one's output and LSE
// (natural log). out_a, out_b, out: (batch, seqlen, heads, head_dim) in the kernel's element
// type, strides in elements, rows 16-byte aligned (head_dim a multiple of 8; packed rows: batch
// 1); lse_a, lse_b, lse: fp32 (batch, heads, seqlen), a row's entries contiguous. lse may be
// null. out may alias out_a or out_b (each element is read before it is written, by one thread).
typedef struct FagenMergeParams {
    const void* out_a;
    const float* lse_a;
    const void* out_b;
    const float* lse_b;
    void* out;
    float* lse;
    long long out_a_batch_stride, out_a_row_stride, out_a_head_stride;
    long long out_b_batch_stride, out_b_row_stride, out_b_head_stride;
    long long out_batch_stride, out_row_stride, out_head_stride;
    long long lse_a_batch_stride, lse_a_head_stride;
    long long lse_b_batch_stride, lse_b_head_stride;
    long long lse_out_batch_stride, lse_out_head_stride;
    int batch;
    int seqlen;
    int heads;
    int head_dim;
} FagenMergeParams;

// A CUtensorMap (cuda.h) as an opaque, 64-byte-aligned blob: kernels built with NVRTC cannot
// include cuda.h, and the layout is the driver's business anyway.
typedef struct FagenTensorMap {
#ifdef __cplusplus
    alignas(64)
#else
    _Alignas(64)
#endif
    unsigned long long opaque[16];
} FagenTensorMap;

// The second parameter of the TMA kernels (FA3, FA4): tiled maps of Q, K and V over the 4-D
// tensors (head_dim, seqlen, heads, batch), 128-byte swizzle, boxes of one 128-byte row (64
// fp16/bf16 columns, 128 e4m3) and the kernel's block_m (Q) or block_n (K, V) rows; the
// manifest's launch info gives the box rows (a paged prefill's K/V: fagen/contract.py,
// cache_box_rows).
typedef struct FagenTmaMaps {
    FagenTensorMap q;
    FagenTensorMap k;
    FagenTensorMap v;
} FagenTmaMaps;

// The second parameter of the TMA backward kernels (FA3): Q and dO with boxes of the kernel's
// block_m rows (the query block of a step), K and V with block_n rows (the CTA's key block),
// otherwise as FagenTmaMaps; and dQ's fp32 accumulator (FagenBwdParams.dq_accum as a (head_dim,
// seqlen_q, heads_q, batch) tensor) with boxes of 32 columns (128 bytes) and block_m rows, which
// the kernel adds its parts of dQ to.
typedef struct FagenBwdTmaMaps {
    FagenTensorMap q;
    FagenTensorMap k;
    FagenTensorMap v;
    FagenTensorMap dout;
    FagenTensorMap dq_accum;
} FagenBwdTmaMaps;

#ifdef __cplusplus
}
#endif
