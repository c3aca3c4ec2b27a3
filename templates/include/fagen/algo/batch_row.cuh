// Where one batch row's tokens are in the dense, the varlen or the paged layout (fagen/contract.py:
// LAYOUTS), for the forward and backward kernels that take them (RowLayout; Config::kVarlen is
// the varlen one's, FA3's Config::kPaged the paged one's).
//
// Dense: every batch row has seqlen_q queries and seqlen_k keys, a block of its own that the
// batch strides select; the row arrays (the LSE, the backward's workspace) are (batch, heads,
// seqlen_q). Varlen: q, o, dO, dQ are packed by cu_seqlens_q and k, v, dK, dV by cu_seqlens_k
// ((total, heads, head_dim), batch strides 0), seqlen_q and seqlen_k are the longest rows' and
// only size the grid; the row arrays are (heads, total_q: FagenBwdParams) and the dQ accumulator holds
// contract.varlen_accum_rows per head, each batch row's from contract.varlen_accum_begin on.
// Tiles past a row's own length have no work. A tile reads the rows after its batch row's last
// (the next row's tokens): the masks hide the keys past seqlen_k, the backward's LSE of +inf the
// queries past seqlen_q, and no store writes past them.
//
// Paged (the FA3 forward's; FagenFwdParams' serving fields): q dense or packed by cu_seqlens_q,
// each row's keys from seqused_k (+ seqlen_new) in a cache of its own, contiguous or in pages,
// that the kernel reads through algo/kv_cache.cuh's block table from key 0.
//
// A dense BatchRow holds nothing (its lengths are the launch's, its rows start at 0), so that a
// kernel that carries one from tile to tile keeps the registers it had without the layout.
#pragma once
#include "fagen/algo/kv_cache.cuh"
#include "fagen/params.h"

namespace fagen::algo {

// The layouts a BatchRow describes (a kernel's bool kVarlen converts to the first two).
enum RowLayout : int { kDenseRows = 0, kVarlenRows = 1, kPagedRows = 2 };

// Keys of batch row `batch` that a call uses: seqused_k caps them in a forward.
__device__ __forceinline__ int used_keys(const FagenFwdParams& p, int batch, int keys) {
    return p.seqused_k != nullptr ? min(p.seqused_k[batch], keys) : keys;
}
__device__ __forceinline__ int used_keys(const FagenBwdParams&, int, int keys) { return keys; }

template <int kLayout, int kAccumRowAlign = 16>
struct BatchRow {
    // Whether a batch row has lengths of its own (varlen, paged), so that a tile the grid sized
    // from the longest row may lie past its queries or keys.
    static constexpr bool kOwnLengths = false;
    template <class Params>
    static __device__ __forceinline__ BatchRow of(const Params&, int) { return {}; }

    template <class Params>
    __device__ __forceinline__ int seqlen_q(const Params& p) const { return p.seqlen_q; }
    template <class Params>
    __device__ __forceinline__ int seqlen_k(const Params& p) const { return p.seqlen_k; }
    __device__ __forceinline__ int q_begin() const { return 0; }  // its first query's row in q, o, dO, dQ
    __device__ __forceinline__ int k_begin() const { return 0; }  // its first key's row in k, v, dK, dV
    // The batch coordinate of a TMA load of its rows.
    __device__ __forceinline__ int tma_batch(int batch) const { return batch; }

    // Entries per head of a row array, and the first of (batch, head).
    template <class Params>
    __device__ __forceinline__ int rows_per_head(const Params& p) const { return p.seqlen_q; }
    template <class Params>
    __device__ __forceinline__ long long row_array(const Params& p, int batch, int head) const {
        return (static_cast<long long>(batch) * p.heads_q + head) * p.seqlen_q;
    }
    // The dQ accumulator's rows per head, and the first of (batch, head).
    template <class Params>
    __device__ __forceinline__ long long accum_rows(const Params& p) const {
        return (p.seqlen_q + kAccumRowAlign - 1) / kAccumRowAlign * kAccumRowAlign;
    }
    template <class Params>
    __device__ __forceinline__ long long accum_row(const Params& p, int batch, int head) const {
        return (static_cast<long long>(batch) * p.heads_q + head) * accum_rows(p);
    }
    // Its first row within a head's accumulator rows.
    __device__ __forceinline__ int accum_begin(int /*batch*/) const { return 0; }
};

template <int kAccumRowAlign>
struct BatchRow<kVarlenRows, kAccumRowAlign> {
    static constexpr bool kOwnLengths = true;
    int queries, keys, first_query, first_key;

    template <class Params>
    static __device__ __forceinline__ BatchRow of(const Params& p, int batch) {
        const int q_begin = p.cu_seqlens_q[batch], k_begin = p.cu_seqlens_k[batch];
        return {p.cu_seqlens_q[batch + 1] - q_begin, used_keys(p, batch, p.cu_seqlens_k[batch + 1] - k_begin),
                q_begin, k_begin};
    }

    template <class Params>
    __device__ __forceinline__ int seqlen_q(const Params&) const { return queries; }
    template <class Params>
    __device__ __forceinline__ int seqlen_k(const Params&) const { return keys; }
    __device__ __forceinline__ int q_begin() const { return first_query; }
    __device__ __forceinline__ int k_begin() const { return first_key; }
    __device__ __forceinline__ int tma_batch(int) const { return 0; }  // the maps span the packed rows

    // The row arrays and the accumulator of a backward (FagenBwdParams: total_q rows per head).
    __device__ __forceinline__ int rows_per_head(const FagenBwdParams& p) const { return p.total_q; }
    __device__ __forceinline__ long long row_array(const FagenBwdParams& p, int, int head) const {
        return static_cast<long long>(head) * p.total_q + first_query;
    }
    __device__ __forceinline__ long long accum_rows(const FagenBwdParams& p) const {
        const long long padded = (p.total_q + kAccumRowAlign - 1) / kAccumRowAlign * kAccumRowAlign;
        return padded + static_cast<long long>(kAccumRowAlign) * p.batch;
    }
    __device__ __forceinline__ long long accum_row(const FagenBwdParams& p, int batch, int head) const {
        return head * accum_rows(p) + accum_begin(batch);
    }
    __device__ __forceinline__ int accum_begin(int batch) const {
        return (first_query + kAccumRowAlign * batch) / kAccumRowAlign * kAccumRowAlign;
    }
};

template <int kAccumRowAlign>
struct BatchRow<kPagedRows, kAccumRowAlign> {
    static constexpr bool kOwnLengths = true;
    int queries, keys, first_query, q_map_batch;

    static __device__ __forceinline__ BatchRow of(const FagenFwdParams& p, int batch) {
        const Sequence s = Sequence::of(p, batch);
        return {s.seqlen_q, s.seqlen_k, s.q_begin, p.cu_seqlens_q != nullptr ? 0 : batch};
    }

    __device__ __forceinline__ int seqlen_q(const FagenFwdParams&) const { return queries; }
    __device__ __forceinline__ int seqlen_k(const FagenFwdParams&) const { return keys; }
    __device__ __forceinline__ int q_begin() const { return first_query; }
    __device__ __forceinline__ int k_begin() const { return 0; }  // keys are addressed per page
    // The batch coordinate of a TMA load of its queries: a packed q's map spans the packed rows.
    __device__ __forceinline__ int tma_batch(int) const { return q_map_batch; }
};

}  // namespace fagen::algo
