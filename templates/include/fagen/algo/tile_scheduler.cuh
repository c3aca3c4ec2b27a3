// Which query block a CTA of a (query blocks, heads, batch) grid computes.
#pragma once

namespace fagen::algo {

// Under a causal mask the last query blocks visit the most key blocks. The hardware hands out
// CTAs roughly in blockIdx order, so causal grids run the heaviest blocks first and the light
// ones fill the tail of the wave instead of leaving SMs idle behind one long block.
template <bool kCausal>
__device__ __forceinline__ int query_block_index() {
    if constexpr (kCausal) {
        return static_cast<int>(gridDim.x - 1 - blockIdx.x);
    } else {
        return static_cast<int>(blockIdx.x);
    }
}

}  // namespace fagen::algo
