// What the backward kernels (FA2, FA3, FA4) share about a key-block tile: its place in the launch
// order and in the deterministic mode's dQ order, its walk, and the mask of its transposed scores.
//
// Deterministic mode: the tiles of one query block add their part of dQ in a fixed order. Each
// waits for the block's counter (one int per (batch, head_q, query block)) to reach its rank,
// adds, and passes the counter on; so every run sums in the same order. A tile waits only for
// tiles launched before it (blocks start in launch order), so that a key block whose
// predecessor is not resident yet cannot hold the SM the predecessor needs. Without the mask
// every key block walks the query blocks from 0, and the order is ascending. Under a mask with a
// right edge (causal, a window) a key block starts at its diagonal query block, so the higher key
// blocks reach a query block first: the order is descending, and the key blocks are launched from the last (ascending, each CTA waited
// for key block 0 to walk up to it: 3-4.6x the time of the atomics, run 69).
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"

namespace fagen::algo {

template <class Mask, int kBlockM, int kBlockN>
struct TileOrder {
    static constexpr bool kDiagonal = Mask::kRightEdge;  // a right edge: see above
    // About the tiles that run at once, one CTA per SM: 132 on an H100 / H200, 108 on an A100.
    static constexpr int kConcurrentTiles = 128;

    struct Tile {
        int n_block;
        int head_of_batch;  // batch * heads_kv + K/V head
    };

    // The tile at launch position `position` (the CTA index, x fastest) of n_blocks key blocks
    // for each of heads_of_batch (batch, K/V head) pairs. Without the mask every tile does the
    // same work: the key block fastest, so that the tiles that run at once share their head's
    // Q, dO and dQ in L2 (with every head at once the FA3 backward ran at 0.71-0.98x, run 78).
    // Under it key block j walks fewer query blocks the larger j is, and with each head's key
    // blocks in turn the last heads' heaviest tiles started last and ran on alone: groups of
    // about kConcurrentTiles tiles (whole heads), their key blocks from the first, heads fastest,
    // keep the heads of a wave few and leave the light tiles for the end (run 110 has the
    // effect). The deterministic mode reverses the key blocks (above).
    static __device__ Tile at(const FagenBwdParams& p, int position, int n_blocks, int heads_of_batch) {
        int order = position % n_blocks, head_of_batch = position / n_blocks;
        if constexpr (kDiagonal) {
            const int group = min(heads_of_batch, (kConcurrentTiles + n_blocks - 1) / n_blocks);
            const int first = position / (group * n_blocks) * group;
            const int heads = min(group, heads_of_batch - first);
            const int within = position - first * n_blocks;
            order = within / heads;
            head_of_batch = first + within % heads;
        }
        return {kDiagonal && p.dq_semaphore != nullptr ? n_blocks - 1 - order : order, head_of_batch};
    }

    // How many key blocks add to query block i before key block j does.
    static __device__ int rank(const Mask& mask, int i, int j) {
        if constexpr (!kDiagonal) return j;
        // The key blocks that see query block i run up to the block of the last key its last row
        // sees (AttentionMask::query_blocks: each walks every query block with a row that sees
        // one of its keys).
        return (mask.key_end((i + 1) * kBlockM - 1) - 1) / kBlockN - j;
    }

    // The counter of query block m_block of query head `head_of_batch` (batch * heads_q + head).
    static __device__ int* semaphore(const FagenBwdParams& p, int head_of_batch, int m_block) {
        const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
        return p.dq_semaphore + static_cast<long long>(head_of_batch) * m_blocks + m_block;
    }
};

// A key-block tile's walk over (query head, query block) pairs, heads outer, advanced one step
// at a time: a division of the step index by the blocks per head cost the FA2 backward ~25
// instructions twice a step, and the FA3 backward's flat count spilled at head_dim 128, causal.
struct StepCursor {
    int head, block;

    // The next pair; query blocks [first_block, end_block) of each head.
    __device__ __forceinline__ void advance(int first_block, int end_block) {
        if (++block == end_block) {
            block = first_block;
            ++head;
        }
    }
};

// The walk of one backward tile: key block n_block of K/V head kv_head of batch row `batch`, over
// the query blocks [i_begin, i_begin + i_count) (the mask's query_blocks: those with a row that
// sees one of its keys; none for a key block past its batch row's keys) of each of the `group`
// query heads its K/V head serves, heads outer. `Row` is the layout's batch row
// (algo/batch_row.cuh); one tile per CTA, in the launch order of TileOrder.
template <class Mask, class Row, int kBlockM, int kBlockN>
struct BackwardWalk {
    using Order = TileOrder<Mask, kBlockM, kBlockN>;

    int n_block, kv_head, batch, group, i_begin, i_count;
    Row seq;

    static __device__ BackwardWalk of_cta(const FagenBwdParams& p) {
        const int tile = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        BackwardWalk w;
        const int n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
        const typename Order::Tile at = Order::at(p, tile, n_blocks, p.batch * p.heads_kv);
        w.n_block = at.n_block;
        w.kv_head = at.head_of_batch % p.heads_kv;
        w.batch = at.head_of_batch / p.heads_kv;
        w.group = p.heads_q / p.heads_kv;
        w.seq = Row::of(p, w.batch);
        const KeyBlocks queries = w.mask(p).query_blocks(w.key_begin(), kBlockN, kBlockM);
        w.i_begin = queries.begin;
        w.i_count = Row::kOwnLengths && w.key_begin() >= w.seq.seqlen_k(p) ? 0 : max(0, queries.count());
        return w;
    }

    __device__ __forceinline__ int key_begin() const { return n_block * kBlockN; }
    // The first entry of query head `head`'s rows in the workspace arrays (LSE, D).
    __device__ __forceinline__ long long head_row0(const FagenBwdParams& p, int head) const {
        return seq.row_array(p, batch, head);
    }
    __device__ __forceinline__ Mask mask(const FagenBwdParams& p) const {
        return Mask::of(p, batch, seq.seqlen_q(p), seq.seqlen_k(p));
    }
    __device__ __forceinline__ int steps() const { return i_count * group; }
    __device__ __forceinline__ int i_end() const { return i_begin + i_count; }
    __device__ __forceinline__ StepCursor first_step() const { return {kv_head * group, i_begin}; }
};

// Zeroes the probabilities the mask hides in a warp's rows of a transposed score tile (rows are
// keys from first_key, columns queries from first_query, the accumulator layout). Every step
// whose keys reach past seqlen_k needs it, causal or not: a zero-filled key's probability
// exp2(0 - LSE2) is not small, and overflows when the row's LSE is far below 0. The kernels call
// it as a branch of its own on the steps that need it: folded into the exponentials' loop as a
// predicate per element, the mask's compares and selects ran on every step, and a causal step
// took 1.31x a non-causal one (1.84 against 1.40 us at head_dim 64, 2k; run 88).
template <class Mask, int kTiles>
__device__ __forceinline__ void zero_masked_probs(const Mask& mask, float (&probs)[kTiles][4],
                                                  int lane, int first_key, int first_query) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const FragmentCoord f = fragment_coord(lane, 0, n, i);
            if (mask.masked(first_query + f.col, first_key + f.row)) probs[n][i] = 0.f;
        }
    }
}

}  // namespace fagen::algo
