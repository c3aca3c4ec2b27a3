// Which (query row, key column) pairs attend, and which key blocks a query block must visit: the
// one place the kernels ask, for every kind of mask (MaskKind), forward and backward.
//
// Every mask is a band aligned to the bottom-right corner (flash-attn >= 2.1): with
// offset = seqlen_k - seqlen_q, query row i sees keys j with
//     i + offset - window_left <= j <= i + offset + window_right,   0 <= j < seqlen_k,
// so the last query row's diagonal is the last key. kFull has neither edge, kCausal the right
// edge at window_right = 0, kLocal both edges at the launch's window sizes (FagenFwdParams /
// FagenBwdParams: window_left, window_right, which the host normalises: an unbounded edge is
// seqlen_q + seqlen_k, past every key). Rows that see no key at all (causal with
// seqlen_q > seqlen_k, a window that ends before key 0 or starts past the last) get O = 0 and
// LSE = -inf.
//
// Because both edges move one key per row, the keys a block of rows sees are the keys between
// its first row's left edge and its last row's right edge: a query block visits the key blocks
// [begin, end) of KeyBlocks, and time follows the window, not seqlen_k. The kernels visit them
// from the last down (the diagonal block first, where the row maximum usually is).
//
// kCustom is a user's mask, compiled in ahead of time (CustomMask below): the spec names its
// header and type, the launch passes its arguments (FagenFwdParams / FagenBwdParams: mask_args).
// A kernel's Config names its mask type (Config::Mask): AttentionMask<kMask> or CustomMask<User>.
#pragma once
#include "fagen/algo/fragment.cuh"

namespace fagen::algo {

enum class MaskKind : int { kFull = 0, kCausal = 1, kLocal = 2, kCustom = 3 };

// Key blocks [begin, end) of a query block; count() <= 0 when none of its rows sees a key.
struct KeyBlocks {
    int begin;
    int end;
    __device__ __forceinline__ int count() const { return end - begin; }
};

// The iterations (j = 0 .. n_blocks-1 visits key block end-1-j) that may hold a masked pair for
// some row of a query block: j < right_end (the right edge and seqlen_k) and j >= left_begin
// (the left edge); the ones between need no mask code at all.
struct MaskedIterations {
    int right_end;
    int left_begin;
};

template <MaskKind kKind>
struct AttentionMask {
    static constexpr bool kRightEdge = kKind != MaskKind::kFull;
    static constexpr bool kLeftEdge = kKind == MaskKind::kLocal;

    int seqlen_q;
    int seqlen_k;
    int window_left;   // kLocal only
    int window_right;  // kLocal only

    // The mask of a launch (FagenFwdParams or FagenBwdParams), for batch row `batch` (which
    // only a custom mask reads), whose row has seqlen_q queries and seqlen_k keys (the
    // launch's, unless varlen: algo/batch_row.cuh).
    template <class Params>
    static __device__ __forceinline__ AttentionMask of(const Params& p, int /*batch*/ = 0) {
        return {p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    }
    template <class Params>
    static __device__ __forceinline__ AttentionMask of(const Params& p, int /*batch*/, int seqlen_q,
                                                       int seqlen_k) {
        return {seqlen_q, seqlen_k, p.window_left, p.window_right};
    }

    __device__ __forceinline__ int causal_offset() const { return seqlen_k - seqlen_q; }
    __device__ __forceinline__ int right() const {
        if constexpr (kKind == MaskKind::kLocal) return window_right;
        return 0;
    }

    // The first key query row `row` sees (keys [key_begin(row), key_end(row)) attend).
    __device__ __forceinline__ int key_begin(int row) const {
        if constexpr (kLeftEdge) return max(0, row + causal_offset() - window_left);
        return 0;
    }

    // One past the last key query row `row` sees.
    __device__ __forceinline__ int key_end(int row) const {
        if constexpr (kRightEdge) return min(seqlen_k, row + causal_offset() + right() + 1);
        return seqlen_k;
    }

    // The key blocks of `block_n` keys that query rows [row_begin, row_begin + block_m) touch.
    __device__ __forceinline__ KeyBlocks key_blocks(int row_begin, int block_m, int block_n) const {
        return {key_begin(row_begin) / block_n, (key_end(row_begin + block_m - 1) + block_n - 1) / block_n};
    }

    // Whether key block `n_block` of `block_n` keys holds a pair that must be masked for some of
    // the `rows` query rows from `row_begin`: keys past seqlen_k, right of the first row's right
    // edge or left of the last row's left edge. Called with a warp's rows, so on an edge block
    // only the warps it crosses pay for the mask.
    __device__ __forceinline__ bool block_needs_mask(int n_block, int row_begin, int rows, int block_n) const {
        const int first_key = n_block * block_n, last_key = first_key + block_n - 1;
        bool needs = last_key >= seqlen_k;
        if constexpr (kRightEdge) needs = needs || last_key > row_begin + causal_offset() + right();
        if constexpr (kLeftEdge) needs = needs || first_key < row_begin + rows - 1 + causal_offset() - window_left;
        return needs;
    }

    // Whether any pair of the keys [key_begin, key_begin + block_n) may be masked for some row:
    // a mask with an edge, or keys past seqlen_k. A tile for which this is false needs no mask code.
    __device__ __forceinline__ bool tile_may_need_mask(int key_begin, int block_n) const {
        return kRightEdge || kLeftEdge || key_begin + block_n > seqlen_k;
    }

    // The iterations over `blocks` (visited from the last) that may need the mask for some of the
    // `block_m` rows from `row_begin`, counted from the block's first and last rows so that every
    // warp of the block gets the same bounds.
    __device__ __forceinline__ MaskedIterations masked_iterations(const KeyBlocks& blocks, int row_begin,
                                                                 int block_m, int block_n) const {
        const int n = blocks.count();
        // Key blocks below key_end(row_begin) / block_n are whole for every row from row_begin on.
        const int right_end = min(n, blocks.end - max(key_end(row_begin), 0) / block_n);
        int left_begin = n;
        if constexpr (kLeftEdge) {
            // Key blocks from ceil(key_begin(last row) / block_n) on are whole for every row up to it.
            left_begin = max(0, blocks.end - (key_begin(row_begin + block_m - 1) + block_n - 1) / block_n);
        }
        return {right_end, left_begin};
    }

    // Whether query row `row` does not see key `key`.
    __device__ __forceinline__ bool masked(int row, int key) const {
        bool out = key >= seqlen_k;
        if constexpr (kRightEdge) out = out || key > row + causal_offset() + right();
        if constexpr (kLeftEdge) out = out || key < row + causal_offset() - window_left;
        return out;
    }

    // The first query row that sees key `key` (< seqlen_k): the rows [first_row(key), row_end(key)).
    __device__ __forceinline__ int first_row(int key) const {
        if constexpr (kRightEdge) return max(0, key - causal_offset() - right());
        return 0;
    }
    __device__ __forceinline__ int row_end(int key) const {
        if constexpr (kLeftEdge) return min(seqlen_q, key - causal_offset() + window_left + 1);
        return seqlen_q;
    }

    // The query blocks of `block_m` rows that see some key of [key_begin, key_begin + block_n):
    // what a backward tile of those keys walks. count() <= 0 when no row sees them.
    __device__ __forceinline__ KeyBlocks query_blocks(int key_begin, int block_n, int block_m) const {
        const int last_key = min(key_begin + block_n, seqlen_k) - 1;
        return {first_row(key_begin) / block_m, (row_end(last_key) + block_m - 1) / block_m};
    }

    // Sets masked scores to -inf in a row-pair fragment whose rows start at `row_base` and whose
    // columns start at `col_base` (absolute query / key indices).
    template <int kM, int kN>
    __device__ __forceinline__ void apply(float (&acc)[kM][kN][4], int lane, int row_base,
                                          int col_base) const {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int n = 0; n < kN; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const FragmentCoord c = fragment_coord(lane, m, n, i);
                    const int row = row_base + c.row;
                    const int col = col_base + c.col;
                    // masked(row, col), written out: the call reorders the forward kernels'
                    // predicates (other SASS than the measured cubins).
                    bool masked = col >= seqlen_k;
                    if constexpr (kRightEdge) masked = masked || col > row + causal_offset() + right();
                    if constexpr (kLeftEdge) masked = masked || col < row + causal_offset() - window_left;
                    if (masked) acc[m][n][i] = neg_inf();
                }
            }
        }
    }
};

// The keys [begin, end) a run of query rows may see, or the rows a run of keys may be seen by:
// what a custom mask's range functions return.
struct IndexRange {
    int begin;
    int end;
};

// A user's mask as the kernels ask for one (AttentionMask's interface). `User` is a type of the
// user's header with
//     static __device__ User of(const void* mask_args, int batch, int seqlen_q, int seqlen_k);
//     __device__ bool masked(int row, int key) const;        // query row `row` does not see `key`
//     __device__ IndexRange keys_of_rows(int row_begin, int row_end) const;
//     __device__ IndexRange rows_of_keys(int key_begin, int key_end) const;
//     __device__ bool all_visible(int row_begin, int row_end, int key_begin, int key_end) const;
// The ranges may be wider than the mask but never narrower: a query block visits the key blocks
// its rows' range touches (time follows the range, not seqlen_k), a backward key block walks the
// query blocks its keys' range touches. A visited block is masked element by element unless
// all_visible says every row of it sees every key (false is always correct, only slower). The
// user's functions see rows below seqlen_q and keys below seqlen_k only: the rest are masked
// here.
template <class User>
struct CustomMask {
    static constexpr bool kRightEdge = true;  // any visited pair may be masked
    static constexpr bool kLeftEdge = true;

    User user;
    int seqlen_q;
    int seqlen_k;

    template <class Params>
    static __device__ __forceinline__ CustomMask of(const Params& p, int batch = 0) {
        return of(p, batch, p.seqlen_q, p.seqlen_k);
    }
    template <class Params>
    static __device__ __forceinline__ CustomMask of(const Params& p, int batch, int seqlen_q, int seqlen_k) {
        return {User::of(p.mask_args, batch, seqlen_q, seqlen_k), seqlen_q, seqlen_k};
    }

    __device__ __forceinline__ IndexRange keys_of(int row_begin, int rows) const {
        if (row_begin >= seqlen_q) return {0, 0};
        const IndexRange r = user.keys_of_rows(row_begin, min(row_begin + rows, seqlen_q));
        return {max(r.begin, 0), min(r.end, seqlen_k)};
    }

    __device__ __forceinline__ int key_begin(int row) const { return keys_of(row, 1).begin; }
    __device__ __forceinline__ int key_end(int row) const { return keys_of(row, 1).end; }

    __device__ __forceinline__ KeyBlocks key_blocks(int row_begin, int block_m, int block_n) const {
        const IndexRange r = keys_of(row_begin, block_m);
        if (r.end <= r.begin) return {0, 0};
        return {r.begin / block_n, (r.end + block_n - 1) / block_n};
    }

    // As AttentionMask's: whether key block `n_block` holds a masked pair for one of the rows.
    __device__ __forceinline__ bool block_needs_mask(int n_block, int row_begin, int rows, int block_n) const {
        const int key_begin = n_block * block_n;
        if (key_begin + block_n > seqlen_k || row_begin + rows > seqlen_q) return true;
        return !user.all_visible(row_begin, row_begin + rows, key_begin, key_begin + block_n);
    }
    __device__ __forceinline__ bool tile_may_need_mask(int, int) const { return true; }

    __device__ __forceinline__ MaskedIterations masked_iterations(const KeyBlocks& blocks, int, int, int) const {
        return {blocks.count(), blocks.count()};
    }

    __device__ __forceinline__ bool masked(int row, int key) const {
        return key >= seqlen_k || row >= seqlen_q || user.masked(row, key);
    }

    __device__ __forceinline__ KeyBlocks query_blocks(int key_begin, int block_n, int block_m) const {
        if (key_begin >= seqlen_k) return {0, 0};
        const IndexRange r = user.rows_of_keys(key_begin, min(key_begin + block_n, seqlen_k));
        const int begin = max(r.begin, 0), end = min(r.end, seqlen_q);
        if (end <= begin) return {0, 0};
        return {begin / block_m, (end + block_m - 1) / block_m};
    }

    template <int kM, int kN>
    __device__ __forceinline__ void apply(float (&acc)[kM][kN][4], int lane, int row_base,
                                          int col_base) const {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int n = 0; n < kN; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const FragmentCoord c = fragment_coord(lane, m, n, i);
                    if (masked(row_base + c.row, col_base + c.col)) acc[m][n][i] = neg_inf();
                }
            }
        }
    }
};

}  // namespace fagen::algo
