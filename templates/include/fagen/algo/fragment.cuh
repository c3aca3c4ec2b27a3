// The accumulator fragment shape shared by mma.sync (m16n8) and wgmma (m64nN, per warp): a
// thread holds, for each 16-row tile m and each 8-column tile n, four floats
//   acc[m][n][0..1] = row (16m + group),     columns (8n + 2*quad, +1)
//   acc[m][n][2..3] = row (16m + group + 8), columns (8n + 2*quad, +1)
// with lane = 4*group + quad. A row's values are spread over the 4 lanes of a quad, so row
// reductions are thread-local folds followed by two xor-shuffles.
#pragma once

namespace fagen::algo {

// -inf without <cmath>, which NVRTC only offers through CCCL (seconds per compile).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

struct FragmentCoord {
    int row;  // within the warp's rows
    int col;  // within the tile's columns
};

__device__ __forceinline__ FragmentCoord fragment_coord(int lane, int m, int n, int i) {
    return {16 * m + (lane >> 2) + 8 * (i >> 1), 8 * n + 2 * (lane & 3) + (i & 1)};
}

// f(coord, lo, hi) for each pair of adjacent columns the thread holds: acc[m][n][2h], [2h + 1]
// at coord = fragment_coord(lane, m, n, 2h) (a 32-bit store of two packed elements each).
template <int kM, int kN, class F>
__device__ __forceinline__ void for_each_pair(const float (&acc)[kM][kN][4], int lane, F&& f) {
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) f(fragment_coord(lane, m, n, 2 * h), acc[m][n][2 * h], acc[m][n][2 * h + 1]);
}

template <int kM, int kN>
__device__ __forceinline__ void clear_fragment(float (&acc)[kM][kN][4]) {
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;
}

// The same for one row of tiles (a wgmma accumulator: kN n8 tiles of a warpgroup's m64).
template <int kN>
__device__ __forceinline__ void clear_fragment(float (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace fagen::algo
