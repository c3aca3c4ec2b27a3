// Online softmax in base 2 with the softmax scale folded into the exponent, normalization
// deferred to the end (FlashAttention-2, section 3.1.1).
//
// For each row the state is the running maximum m of the raw scores and a thread-partial sum
// l of exp2(s * scale_log2 - m2), m2 = fl(m * scale_log2) (algo/lse.cuh). A new block of scores
// rescales l and the output accumulator by exp2(m2_old - m2_new) and replaces the scores by
// probabilities; at the end O / l is exact and LSE = (m2 + log2 l) * ln 2.
//
// P V multiplies P rounded to 16 bits, l sums it unrounded. Where one key dominates a row its P
// is 2^r (r: the rounding of m2, algo/lse.cuh), so O = round16(2^r) V / 2^r: an ulp off V's row at
// large scores, and that ulp became D - dP != 0 in the backward, hence dQ = scale * dS K errors
// proportional to |K| (10-100x past the bar with inputs x16 and outliers). So O is divided by
// l + round16(P_top) - P_top, P_top the probability of the key at the final reference maximum,
// recomputed in finalize() (its block set the reference, so it got exactly that exponent, and
// every later rescale of it was exp2(0) = 1): O is exact for that key as P V saw it, which is V's
// row where it dominates. The LSE keeps l, whose 2^r is the one the exponents carry. Once per
// row, not per score: an FFMA, an exponential and a conversion (one FMUL per score instead cost
// the hd64 forward 3-5 %, 2026-12-01). With conditional rescaling the reference may lag the
// maximum, so there each block's largest probability is corrected as it goes (row_rounding).
//
// Ops::kProbabilityLog2Offset (e4m3's P): the exponents are taken against m2 - offset, so that a
// row's probabilities reach 2^offset instead of 1 and P rounded to e4m3 keeps its 3 mantissa bits
// down to probabilities of 2^(offset - 6) of the maximum instead of 2^-6 (e4m3's smallest normal);
// l carries the same factor, so O / l is unchanged and the LSE subtracts the offset again
// (FlashAttention-3 offsets its FP8 softmax the same way).
//
// Fully masked rows keep m = -inf. Using 0 as the subtrahend then keeps every exponent -inf
// (probability 0) instead of NaN from (-inf) - (-inf).
//
// Conditional rescaling (FlashAttention-4): m need not be the true running maximum, only a
// reference that O and l share. While a new block's maximum exceeds the reference by at most
// kRescaleThreshold (base 2, scaled units: 8 = log2 256) the reference stays and the O / l
// rescale is skipped; probabilities are then at most 2^threshold instead of 1, which fp32 O and
// l absorb. Since both were accumulated against the same reference, O / l at the end is exact.
//
// kSumInOutput: the kernel's P V also multiplies P by a column of ones, so the output
// accumulator's last n8 tile holds each row's complete sum of the probabilities as they went into
// P V (rounded to 16 bits, like the numerator), rescaled along with O. The softmax then keeps no
// sum of its own: that saves one add per score, a serial chain per row.
#pragma once
#include "fagen/algo/exp2_emulation.cuh"
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/ptx/ex2.cuh"

namespace fagen::algo {

// The softmax options a kernel's Config may set (the same names): the defaults are plain
// FlashAttention-2 (hardware exp2, rescale whenever the maximum grows).
struct DefaultSoftmaxOptions {
    static constexpr int kExp2EmulationPeriod = 0;  // see exp2_emulation.cuh: softmax_exp2
    static constexpr bool kConditionalRescale = false;
    static constexpr float kRescaleThreshold = 0.f;
};

struct ReferenceMax {
    float value;    // the new reference maximum (raw score units)
    float rescale;  // factor for O and l accumulated against the old reference
};

// The reference after a block whose maximum (including the old reference) is `block_max`.
template <bool kConditional>
__device__ __forceinline__ ReferenceMax next_reference_max(float reference, float block_max,
                                                           float scale_log2, float threshold) {
    if constexpr (kConditional) {
        // -inf reference with a finite block: +inf > threshold, so the first real maximum is
        // always taken. Both -inf: NaN compares false and the row stays empty.
        if (!((block_max - reference) * scale_log2 > threshold)) return {reference, 1.f};
    }
    // exp2(m2_old - m2_new), each m2 the rounding the exponents used (not an FMA, whose exact
    // reference * scale_log2 would put the old m2's rounding into the LSE); an empty row's old
    // reference, -inf, gives a factor of 0 for its O and l of 0.
    const float new_scaled = block_max == neg_inf() ? 0.f : __fmul_rn(block_max, scale_log2);
    return {block_max, ptx::ex2_approx_ftz(__fmul_rn(reference, scale_log2) - new_scaled)};
}

// The subtrahend of the exponent for scores against `reference` (0 for an empty row).
__device__ __forceinline__ float reference_scaled(float reference, float scale_log2) {
    return reference == neg_inf() ? 0.f : __fmul_rn(reference, scale_log2);
}

// A finished row's natural-log LSE from its reference maximum and its (complete) sum: -inf for a
// row that saw no key (sum 0). The exponents were taken against reference_scaled (algo/lse.cuh).
__device__ __forceinline__ float row_lse(float reference, float sum, float scale_log2) {
    return natural_lse(reference_scaled(reference, scale_log2), sum);
}

// round16(P) - P for the probability of score `top` against `subtrahend`, computed as the
// softmax computed it (0 for a row that sees nothing). With exp2 emulation that key may have had
// the polynomial instead (8.6e-5 relative): the correction then carries that difference, far
// below the 16-bit rounding it corrects.
template <class Ops>
__device__ __forceinline__ float operand_rounding(float top, float scale_log2, float subtrahend) {
    const float p = ptx::ex2_approx_ftz(fmaf(top, scale_log2, -subtrahend));
    return Ops::round(p) - p;
}

// What a finished row's output is multiplied by: 1 / sum, and 0 for a row that saw no key.
__device__ __forceinline__ float inverse_row_sum(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }

// An attention sink (a logit of `sink_log2`, base 2, scaled units) beside a row's keys, whose
// exponents were taken against `keys_top` and sum to `sum`: both terms against the larger of the
// two (`top`), so that neither overflows; an empty row (sum 0, its reference a placeholder) is
// the sink alone. The row's LSE is then natural_lse(top, sum * keys + sink).
struct SinkTerm {
    float top;   // the common reference
    float keys;  // what the keys' sum (and O) are multiplied by: exp2(keys_top - top)
    float sink;  // the sink's term: exp2(sink_log2 - top)
};

__device__ __forceinline__ SinkTerm sink_term(float sum, float keys_top, float sink_log2) {
    const float top = sum == 0.f ? sink_log2 : fmaxf(keys_top, sink_log2);
    return {top, sum == 0.f ? 0.f : ptx::ex2_approx_ftz(keys_top - top), ptx::ex2_approx_ftz(sink_log2 - top)};
}

// kM row-pair tiles -> 2*kM rows per thread.
// Ops: the P operand's element operations (algo/element.cuh: round).
template <int kM, class Ops, class Options = DefaultSoftmaxOptions, bool kSumInOutput = false>
struct OnlineSoftmax {
    static constexpr bool kCorrectEachBlock = Options::kConditionalRescale && !kSumInOutput;
    float row_max[kM][2];
    float row_sum[kM][2];  // partial: this thread's columns only, reduced in finalize(); unused
                           // with kSumInOutput (its sum is of the rounded P already)
    // With kConditionalRescale only: round16(P) - P of each block's largest probability, rescaled
    // with l; the same on the row's four threads.
    float row_rounding[kM][2];

    // What the exponents of scores against `reference` subtract (algo/lse.cuh's m2, less the
    // probability offset).
    static __device__ __forceinline__ float subtrahend(float reference, float scale_log2) {
        return reference_scaled(reference, scale_log2) - Ops::kProbabilityLog2Offset;
    }

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_max[m][h] = neg_inf();
                row_sum[m][h] = 0.f;
                row_rounding[m][h] = 0.f;
            }
        }
    }

    // Turns `scores` (raw, masked to -inf) into unnormalized probabilities, updates the row
    // state, and returns in `rescale` the factor the output accumulator must be multiplied by.
    // Split from rescale_output() so a kernel can scale O only once an MMA still writing it
    // has finished.
    template <int kNS>
    __device__ __forceinline__ void update(float (&scores)[kM][kNS][4], float (&rescale)[kM][2],
                                           float scale_log2) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float own_max = neg_inf();  // this block's, without the reference
#pragma unroll
                for (int n = 0; n < kNS; ++n) {
                    own_max = fmaxf(own_max, fmaxf(scores[m][n][2 * h], scores[m][n][2 * h + 1]));
                }
                own_max = quad_max(own_max);
                // own_max and row_max are equal across the quad, so is the decision.
                const ReferenceMax next = next_reference_max<Options::kConditionalRescale>(
                    row_max[m][h], fmaxf(row_max[m][h], own_max), scale_log2, Options::kRescaleThreshold);
                rescale[m][h] = next.rescale;
                row_max[m][h] = next.value;
                const float max_scaled = subtrahend(next.value, scale_log2);
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < kNS; ++n) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        float& s = scores[m][n][2 * h + i];
                        s = softmax_exp2<Options::kExp2EmulationPeriod>(
                            n, fmaf(s, scale_log2, -max_scaled));
                        if constexpr (!kSumInOutput) sum += s;
                    }
                }
                if constexpr (!kSumInOutput) row_sum[m][h] = row_sum[m][h] * rescale[m][h] + sum;
                if constexpr (kCorrectEachBlock) {
                    row_rounding[m][h] = row_rounding[m][h] * rescale[m][h] +
                                         operand_rounding<Ops>(own_max, scale_log2, max_scaled);
                }
            }
        }
    }

    template <int kNO>
    static __device__ __forceinline__ void rescale_output(float (&out)[kM][kNO][4],
                                                          const float (&rescale)[kM][2]) {
        if constexpr (Options::kConditionalRescale) {
            bool needed = false;
#pragma unroll
            for (int m = 0; m < kM; ++m) needed = needed || rescale[m][0] != 1.f || rescale[m][1] != 1.f;
            // Warp-uniform skip: the multiplies are cheap, the divergence would not be.
            if (!__any_sync(0xffffffffu, needed)) return;
        }
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int n = 0; n < kNO; ++n) {
                out[m][n][0] *= rescale[m][0];
                out[m][n][1] *= rescale[m][0];
                out[m][n][2] *= rescale[m][1];
                out[m][n][3] *= rescale[m][1];
            }
        }
    }

    // update() followed by rescale_output(), for kernels whose O is not in flight.
    template <int kNS, int kNO>
    __device__ __forceinline__ void step(float (&scores)[kM][kNS][4], float (&out)[kM][kNO][4],
                                         float scale_log2) {
        float rescale[kM][2];
        update(scores, rescale, scale_log2);
        rescale_output(out, rescale);
    }

    // Normalizes `out` by the row sums and returns each row's natural-log LSE in `lse`.
    // Rows that saw no key get 0 output and LSE = -inf (with a sink: the sink's logit).
    // kSink: the head's attention sink, a logit of `sink_log2` (base 2, scaled units) that joins
    // every row's denominator and adds nothing to O (gpt-oss's sinks; sink_term).
    // `output_scale` multiplies O besides (e4m3's v_descale).
    template <bool kSink = false, int kNO>
    __device__ __forceinline__ void finalize(float (&out)[kM][kNO][4], float (&lse)[kM][2],
                                             float scale_log2, float sink_log2 = 0.f,
                                             float output_scale = 1.f) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // Both columns of the sum tile a thread holds carry its row's sum.
                const float sum = kSumInOutput ? out[m][kNO - 1][2 * h] : quad_sum(row_sum[m][h]);
                float divisor = sum;
                if constexpr (kCorrectEachBlock) {
                    divisor += row_rounding[m][h];
                } else if constexpr (!kSumInOutput) {
                    divisor += operand_rounding<Ops>(row_max[m][h], scale_log2,
                                                     subtrahend(row_max[m][h], scale_log2));
                }
                float inv;
                if constexpr (kSink) {
                    const SinkTerm t = sink_term(sum, subtrahend(row_max[m][h], scale_log2), sink_log2);
                    inv = t.keys / fmaf(divisor, t.keys, t.sink);
                    lse[m][h] = natural_lse(t.top, fmaf(sum, t.keys, t.sink));
                } else {
                    inv = inverse_row_sum(divisor);
                    lse[m][h] = natural_lse(subtrahend(row_max[m][h], scale_log2), sum);
                }
                inv *= output_scale;
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
