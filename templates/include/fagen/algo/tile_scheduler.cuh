// Which (query block, head, batch) tiles a CTA computes, in which order.
//
// Non-persistent grids are (query blocks, heads, batch): one tile per CTA. Query blocks run
// innermost, so the CTAs running together share one head's K/V in L2 (with query blocks
// outermost a causal 4k hd128 run streams ~2 GB of K/V from DRAM instead). Under a causal mask
// the last query blocks visit the most key blocks; the hardware hands out CTAs roughly in index
// order, so each head's heaviest block goes first and its light ones fill in behind. Under a
// window every query block visits about as many key blocks as the next: the plain order.
//
// Persistent grids are (min(work, SMs), 1, 1): each CTA walks work items blockIdx.x,
// blockIdx.x + gridDim.x, ..., so a warp-specialized producer can load the next tile while the
// consumers finish the current one. That static assignment needs items of equal cost. Without a
// mask every tile costs the same. With a causal mask a tile's cost grows with its query block,
// so an item is a pair of tiles of one head, query blocks m_blocks-1-p and p (heavy, then
// light), which together always visit about m_blocks + 1 blocks' worth of keys.
//
// Work indices: tile t of a pair item s is index 2s + t; a walk is
//     for (int i = sched.first(); i < sched.end(); i = sched.next(i)) { sched.tile(i) ... }
#pragma once
#include "fagen/algo/batch_row.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/params.h"

namespace fagen::algo {

struct Tile {
    int m_block;
    int head;
    int batch;
};

template <MaskKind kMask, bool kPersistent>
struct TileScheduler {
    static constexpr bool kCausal = kMask == MaskKind::kCausal;
    static constexpr bool kPaired = kCausal && kPersistent;

    int m_blocks;
    int heads;
    int batch;

    // The scheduler of a launch with query blocks of `block_m` rows.
    static __device__ __forceinline__ TileScheduler for_params(const FagenFwdParams& p, int block_m) {
        return {(p.seqlen_q + block_m - 1) / block_m, p.heads_q, p.batch};
    }

    __device__ __forceinline__ int pairs_per_head() const { return (m_blocks + 1) / 2; }

    // Work items: tiles, or pair items when kPaired. A persistent launch has min(tiles, SMs)
    // CTAs (fagen/runtime/loader.py launch_grid); one whose first item is past the end idles.
    __device__ __forceinline__ int work_items() const {
        return (kPaired ? pairs_per_head() : m_blocks) * heads * batch;
    }
    __device__ __forceinline__ int end() const { return kPaired ? 2 * work_items() : work_items(); }

    __device__ __forceinline__ int first() const {
        if constexpr (kPersistent) {
            return kPaired ? 2 * static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
        } else {
            return static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
        }
    }

    __device__ __forceinline__ int next(int index) const {
        if constexpr (!kPersistent) {
            return end();
        } else if constexpr (kPaired) {
            const int p = (index / 2) % pairs_per_head();
            // The middle query block of an odd count pairs with itself: one tile only.
            const bool has_light = m_blocks - 1 - p != p;
            return index % 2 == 0 && has_light ? index + 1
                                                : 2 * (index / 2 + static_cast<int>(gridDim.x));
        } else {
            return index + static_cast<int>(gridDim.x);
        }
    }

    __device__ __forceinline__ Tile tile(int index) const {
        if constexpr (kPaired) {
            const int item = index / 2;
            const int p = item % pairs_per_head();
            const int pair = item / pairs_per_head();
            return {index % 2 == 0 ? m_blocks - 1 - p : p, pair % heads, pair / heads};
        } else {
            const int within = index % m_blocks;
            return {kCausal ? m_blocks - 1 - within : within, (index / m_blocks) % heads,
                    index / (m_blocks * heads)};
        }
    }
};

// What a kernel needs to know about its tile: where its rows start, which K/V head it reads
// (GQA/MQA: heads_q / heads_kv query heads share one), which key blocks it visits
// (AttentionMask::key_blocks): n_blocks of them (<= 0 when none of its rows sees a key), the
// j-th being n_block(j), from the last down; and its batch row (algo/batch_row.cuh: nothing in
// the dense layout; varlen: the row's lengths and first rows, and no key blocks for a tile past
// its queries).
// The batch row is a base, not a member: the dense layout's empty one then takes no space (as a
// member it made the Work 28 bytes instead of 24, and a persistent kernel that carries the Work
// from tile to tile spilled).
template <int kLayout = kDenseRows>
struct TileWork : BatchRow<kLayout> {
    int head, batch, kv_head, row_begin, n_end, n_blocks;

    __device__ __forceinline__ BatchRow<kLayout> seq() const { return *this; }
    __device__ __forceinline__ int n_block(int j) const { return n_end - 1 - j; }
    __device__ __forceinline__ KeyBlocks key_blocks() const { return {n_end - n_blocks, n_end}; }
};

// The work of tile `t` under the mask type `Mask` (AttentionMask<kind> or CustomMask<User>).
template <class Mask, int kLayout = kDenseRows>
__device__ __forceinline__ TileWork<kLayout> tile_work(const FagenFwdParams& p, const Tile& t, int block_m,
                                                       int block_n) {
    const int row_begin = t.m_block * block_m;
    const auto seq = BatchRow<kLayout>::of(p, t.batch);
    KeyBlocks blocks = Mask::of(p, t.batch, seq.seqlen_q(p), seq.seqlen_k(p)).key_blocks(row_begin, block_m, block_n);
    if (kLayout != kDenseRows && row_begin >= seq.seqlen_q(p)) blocks = {0, 0};
    return {seq, t.head, t.batch, t.head / (p.heads_q / p.heads_kv), row_begin, blocks.end, blocks.count()};
}

}  // namespace fagen::algo
