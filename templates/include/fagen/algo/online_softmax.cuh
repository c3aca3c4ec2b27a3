// Online softmax in base 2 with the softmax scale folded into the exponent, normalization
// deferred to the end (FlashAttention-2, section 3.1.1).
//
// For each row the state is the running maximum m of the raw scores and a thread-partial sum
// l of exp2(s * scale_log2 - m * scale_log2). A new block of scores rescales l and the output
// accumulator by exp2((m_old - m_new) * scale_log2) and replaces the scores by probabilities;
// at the end O / l is exact and LSE = (m * scale_log2 + log2 l) * ln 2.
//
// Fully masked rows keep m = -inf. Using 0 as the subtrahend then keeps every exponent -inf
// (probability 0) instead of NaN from (-inf) - (-inf).
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/ptx/ex2.cuh"

namespace fagen::algo {

// kM row-pair tiles -> 2*kM rows per thread.
template <int kM>
struct OnlineSoftmax {
    float row_max[kM][2];
    float row_sum[kM][2];  // partial: this thread's columns only, reduced in finalize()

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_max[m][h] = neg_inf();
                row_sum[m][h] = 0.f;
            }
        }
    }

    // Turns `scores` (raw, masked to -inf) into unnormalized probabilities and rescales `out`.
    template <int kNS, int kNO>
    __device__ __forceinline__ void step(float (&scores)[kM][kNS][4], float (&out)[kM][kNO][4],
                                         float scale_log2) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float block_max = row_max[m][h];
#pragma unroll
                for (int n = 0; n < kNS; ++n) {
                    block_max = fmaxf(block_max, fmaxf(scores[m][n][2 * h], scores[m][n][2 * h + 1]));
                }
                block_max = quad_max(block_max);
                const float max_scaled = block_max == neg_inf() ? 0.f : block_max * scale_log2;
                const float rescale = ptx::ex2_approx_ftz(row_max[m][h] * scale_log2 - max_scaled);
                row_max[m][h] = block_max;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < kNS; ++n) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        float& s = scores[m][n][2 * h + i];
                        s = ptx::ex2_approx_ftz(fmaf(s, scale_log2, -max_scaled));
                        sum += s;
                    }
                }
                row_sum[m][h] = row_sum[m][h] * rescale + sum;
#pragma unroll
                for (int n = 0; n < kNO; ++n) {
                    out[m][n][2 * h] *= rescale;
                    out[m][n][2 * h + 1] *= rescale;
                }
            }
        }
    }

    // Normalizes `out` by the row sums and returns each row's natural-log LSE in `lse`.
    // Rows that saw no key get 0 output and LSE = -inf.
    template <int kNO>
    __device__ __forceinline__ void finalize(float (&out)[kM][kNO][4], float (&lse)[kM][2],
                                             float scale_log2) {
        constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = quad_sum(row_sum[m][h]);
                const bool empty = sum == 0.f;
                const float inv = empty ? 0.f : 1.f / sum;
                lse[m][h] = empty ? neg_inf() : (row_max[m][h] * scale_log2 + __log2f(sum)) * kLn2;
#pragma unroll
                for (int n = 0; n < kNO; ++n) {
                    out[m][n][2 * h] *= inv;
                    out[m][n][2 * h + 1] *= inv;
                }
            }
        }
    }
};

}  // namespace fagen::algo
