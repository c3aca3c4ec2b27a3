// Which (query block, head, batch) tile a CTA computes.
//
// Non-persistent grids are (query blocks, heads, batch): one tile per CTA. Persistent grids are
// (min(tiles, SMs), 1, 1): each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ..., so a
// warp-specialized producer can load the next tile while the consumers finish the current one.
//
// Under a causal mask the last query blocks visit the most key blocks. The hardware hands out
// CTAs (and a persistent CTA takes tiles) roughly in index order, so causal schedules run the
// heaviest blocks first and the light ones fill the tail instead of leaving SMs idle behind one
// long block.
#pragma once

namespace fagen::algo {

struct Tile {
    int m_block;
    int head;
    int batch;
};

template <bool kCausal>
__device__ __forceinline__ int query_block_index() {
    if constexpr (kCausal) {
        return static_cast<int>(gridDim.x - 1 - blockIdx.x);
    } else {
        return static_cast<int>(blockIdx.x);
    }
}

template <bool kCausal, bool kPersistent>
struct TileScheduler {
    int m_blocks;
    int heads;
    int batch;

    __device__ __forceinline__ int total() const { return m_blocks * heads * batch; }
    __device__ __forceinline__ int first() const {
        if constexpr (kPersistent) {
            return static_cast<int>(blockIdx.x);
        } else {
            return static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
        }
    }
    __device__ __forceinline__ int stride() const {
        return kPersistent ? static_cast<int>(gridDim.x) : total();
    }

    // Query blocks innermost, so the CTAs running together share one head's K/V in L2 (with
    // query blocks outermost a causal 4k hd128 run streams ~2 GB of K/V from DRAM instead);
    // causal: descending within each head, its heaviest tile first.
    __device__ __forceinline__ Tile tile(int index) const {
        const int within = index % m_blocks;
        return {kCausal ? m_blocks - 1 - within : within, (index / m_blocks) % heads,
                index / (m_blocks * heads)};
    }
};

}  // namespace fagen::algo
