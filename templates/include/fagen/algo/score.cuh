// What a score becomes between Q K^T and the softmax: the score modifiers of a kernel
// (Config::kSoftcap, kAlibi; the sinks join the softmax, algo/online_softmax.cuh), forward and
// backward, the one place the kernels ask. With neither, ScoreMod is the identity and compiles
// to nothing.
//
// Units: the kernels keep raw scores s = q . k and take exponents as s * scale_log2
// (algo/lse.cuh). A modifier returns the value u that then stands in for s, so the softmax and
// its LSE are unchanged:
// - softcap (flash-attn's: scores -> softcap * tanh(softmax_scale * s / softcap)): the host
//   launches with scale_log2 = softcap * log2(e) and softcap_scale = softmax_scale / softcap
//   (fagen/contract.py: kernel_score_scale), and u = tanh(softcap_scale * s). The capped score's
//   derivative is softmax_scale * (1 - u^2); the backward applies softmax_scale to dQ and dK
//   anyway, so it multiplies each dS by 1 - u^2 (modify's `dsoftcap`).
// - ALiBi (flash-attn's: -slope * |i + seqlen_k - seqlen_q - j| added to the scaled score): u =
//   s - slope_units * |distance|, slope_units = slope * log2(e) / scale_log2 (the bias in the
//   units of u, softcap or not); a bias does not depend on q or k, so no derivative.
//
// tanh as 1 - 2 / (1 + 2^(2 x log2 e)): two MUFU operations, absolute error ~2e-7.
// tanh.approx.f32 is one, but its relative error of 2^-11 is 0.035 in the base-2 exponent at
// softcap 50 (c = 72), a 2.4 % error of a capped key's probability, six times bf16's rounding.
#pragma once
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/ptx/ex2.cuh"

namespace fagen::algo {

// tanh(x) for the softcap, to ~2e-7 absolute; +-1 at large |x| (the exponent is clamped below
// fp32's overflow, where tanh is 1 to the last bit anyway).
__device__ __forceinline__ float softcap_tanh(float x) {
    const float e = ptx::ex2_approx_ftz(fminf(x * (2.f * kLog2e), 64.f));
    return 1.f - __fdividef(2.f, 1.f + e);
}

template <bool kSoftcap, bool kAlibi>
struct ScoreMod {
    static constexpr bool kIdentity = !kSoftcap && !kAlibi;

    float softcap_scale;  // kSoftcap: softmax_scale / softcap
    float alibi_slope;    // kAlibi: the head's slope in the units of u (see the top of the file)
    int causal_offset;    // seqlen_k - seqlen_q: the distance's origin

    // The modifier of query head `head` of batch `batch` (FagenFwdParams or FagenBwdParams),
    // whose row has seqlen_q queries and seqlen_k keys (the launch's, unless varlen).
    template <class Params>
    static __device__ __forceinline__ ScoreMod of(const Params& p, int batch, int head) {
        return of(p, batch, head, p.seqlen_q, p.seqlen_k);
    }
    template <class Params>
    static __device__ __forceinline__ ScoreMod of(const Params& p, int batch, int head, int seqlen_q,
                                                  int seqlen_k) {
        ScoreMod mod{0.f, 0.f, seqlen_k - seqlen_q};
        if constexpr (kSoftcap) mod.softcap_scale = p.softcap_scale;
        if constexpr (kAlibi) {
            mod.alibi_slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * (kLog2e / p.scale_log2);
        }
        return mod;
    }

    // u of raw score `s` at (query row, key), with 1 - t^2 of the softcap in `dsoftcap`.
    __device__ __forceinline__ float modify(float s, int row, int key, float& dsoftcap) const {
        float u = s;
        if constexpr (kSoftcap) {
            u = softcap_tanh(u * softcap_scale);
            dsoftcap = fmaf(-u, u, 1.f);
        }
        if constexpr (kAlibi) u = fmaf(-alibi_slope, static_cast<float>(abs(row + causal_offset - key)), u);
        return u;
    }

    __device__ __forceinline__ float modify(float s, int row, int key) const {
        float unused;
        return modify(s, row, key, unused);
    }

    // A forward's row-pair fragment (rows: queries from row_base, columns: keys from col_base).
    template <int kM, int kN>
    __device__ __forceinline__ void apply(float (&acc)[kM][kN][4], int lane, int row_base, int col_base) const {
        if constexpr (!kIdentity) {
#pragma unroll
            for (int m = 0; m < kM; ++m)
#pragma unroll
                for (int n = 0; n < kN; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const FragmentCoord c = fragment_coord(lane, m, n, i);
                        acc[m][n][i] = modify(acc[m][n][i], row_base + c.row, col_base + c.col);
                    }
        }
    }
};

// The attention sink of query head `head` in the base-2 scaled units of the softmax (FagenFwdParams
// sinks: natural-log logits of the scaled scores, as gpt-oss's learnable sinks).
template <class Params>
__device__ __forceinline__ float head_sink_log2(const Params& p, int head) {
    return p.sinks[head] * kLog2e;
}

}  // namespace fagen::algo
