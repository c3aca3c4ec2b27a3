// Which (query row, key column) pairs attend, and which key blocks a query block must visit.
//
// Causal attention is aligned to the bottom-right corner (flash-attn >= 2.1): query row i sees
// keys j <= i + (seqlen_k - seqlen_q), so the last query row sees every key. Rows with
// i + seqlen_k - seqlen_q < 0 see no key at all; the kernels write 0 and LSE = -inf for them.
#pragma once
#include "fagen/algo/fragment.cuh"

namespace fagen::algo {

template <bool kCausal>
struct AttentionMask {
    int seqlen_q;
    int seqlen_k;

    __device__ __forceinline__ int causal_offset() const { return seqlen_k - seqlen_q; }

    // Number of key blocks of `block_n` keys that query rows [row_begin, row_begin + block_m)
    // touch; blocks [0, result) are visited. May be <= 0 when no row sees any key.
    __device__ __forceinline__ int key_blocks(int row_begin, int block_m, int block_n) const {
        int keys = seqlen_k;
        if constexpr (kCausal) {
            keys = min(keys, row_begin + block_m + causal_offset());
        }
        return (keys + block_n - 1) / block_n;
    }

    // Whether key block `n_block` holds any (row, key) pair that must be masked for rows from
    // `row_begin` on: past seqlen_k, or (causal) right of the diagonal of row `row_begin`. Called
    // with a warp's first row, so on a diagonal block only the warps it crosses pay for the mask.
    __device__ __forceinline__ bool block_needs_mask(int n_block, int row_begin, int block_n) const {
        const int last_key = (n_block + 1) * block_n - 1;
        bool needs = last_key >= seqlen_k;
        if constexpr (kCausal) {
            needs = needs || last_key > row_begin + causal_offset();
        }
        return needs;
    }

    // Whether any (row, key) pair of the keys [key_begin, key_begin + block_n) may be masked for
    // some row: causal, or keys past seqlen_k. A tile for which this is false needs no mask code.
    __device__ __forceinline__ bool tile_may_need_mask(int key_begin, int block_n) const {
        return kCausal || key_begin + block_n > seqlen_k;
    }

    // How many of the visited key blocks [0, n_blocks) may hold a masked (row, key) pair for
    // rows from `row_begin` on. Those are the last blocks, which the kernels visit first (block
    // n_blocks - 1 - j in iteration j), so iterations j < the result may need a mask.
    __device__ __forceinline__ int masked_key_blocks(int n_blocks, int row_begin, int block_n) const {
        // Keys [0, key_end(row_begin)) attend for every row from row_begin on.
        return n_blocks - min(n_blocks, max(key_end(row_begin), 0) / block_n);
    }

    // One past the last key query row `row` sees: keys [0, result) attend.
    __device__ __forceinline__ int key_end(int row) const {
        int end = seqlen_k;
        if constexpr (kCausal) {
            end = min(end, row + causal_offset() + 1);
        }
        return end;
    }

    // Whether query row `row` does not see key `key` (past seqlen_k, or right of the diagonal).
    __device__ __forceinline__ bool masked(int row, int key) const {
        bool out = key >= seqlen_k;
        if constexpr (kCausal) {
            out = out || key > row + causal_offset();
        }
        return out;
    }

    // The first query row that sees key `key` (< seqlen_k): rows [result, seqlen_q) do.
    __device__ __forceinline__ int first_row(int key) const {
        if constexpr (kCausal) return max(0, key - causal_offset());
        return 0;
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
                    if constexpr (kCausal) {
                        masked = masked || col > row + causal_offset();
                    }
                    if (masked) acc[m][n][i] = neg_inf();
                }
            }
        }
    }
};

}  // namespace fagen::algo
