// FlashAttention-2 split-KV forward over a KV cache on mma.sync (sm_80 and later): the paged
// layout's kernel (fagen/model/fa2_split_kv.py says why it is built this way).
//
// Grid (num_splits, packed query blocks x heads_kv, batch) (fagen/contract.py: GRIDS, splits).
// A CTA takes 16 packed query rows of one K/V head: row r is token r / group of query head
// kv_head * group + r % group (group = heads_q / heads_kv), so one read of a K/V row serves every
// query head it is shared by. The key blocks those rows see (the band of algo/mask.cuh, per batch
// row: algo/kv_cache.cuh) are cut into num_splits ranges, one per CTA; inside a CTA warp w takes
// blocks w, w + kWarps, ... of its range through its own ring of kStages shared-memory slots
// (cp.async, no CTA barrier in the loop) and keeps its own softmax state for the 16 rows. At the
// end the warps' states merge through shared memory; with one split the CTA writes O and LSE,
// otherwise its normalised partial O and LSE, which the combine entry point merges.
#pragma once
#include "fagen/types.cuh"

#include "fagen/algo/element.cuh"
#include "fagen/algo/kv_cache.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/online_softmax.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/smem_rows.cuh"
#include "fagen/params.h"
#include "fagen/ptx/cp_async.cuh"
#include "fagen/ptx/ex2.cuh"
#include "fagen/ptx/ldmatrix.cuh"

namespace fagen::fa2 {

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

template <class Config>
struct SplitKv {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;
    using Mask = typename Config::Mask;
    using Score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>;

    static constexpr int kBlockM = Config::kBlockM;
    static constexpr int kBlockN = Config::kBlockN;
    static constexpr int kWarps = Config::kWarps;
    static constexpr int kStages = Config::kStages;
    static constexpr int kPitch = Config::kRowPitchBytes;    // Q and K rows
    static constexpr int kVPitch = Config::kVRowPitchBytes;  // V rows
    static constexpr int kSTiles = kBlockN / 8;               // n8 tiles of S
    static constexpr int kOTiles = Config::kHeadDimV / 8;     // n8 tiles of O
    static constexpr int kQKSteps = Config::kHeadDim / 16;
    static constexpr int kPVSteps = kBlockN / 16;
    static constexpr int kStats = 3;  // per merged row and warp: scaled maximum, sum, operand rounding

    static_assert(kBlockM == 16, "one m16 tile of packed rows, shared by every warp");
    static_assert(Config::kMask == algo::MaskKind::kLocal, "the band serves full and causal too");
    static_assert(kBlockN % 16 == 0 && Config::kHeadDim % 16 == 0 && Config::kHeadDimV % 16 == 0);
    static_assert(kStages >= 2, "a warp's ring loads block i + kStages - 1 while block i computes");
    static_assert(Config::kSmemWarpStageBytes == kBlockN * (kPitch + kVPitch));
    static_assert(Config::kSmemRingBytes == kWarps * kStages * Config::kSmemWarpStageBytes);
    static_assert(Config::kSmemMergeBytes == kWarps * kBlockM * (Config::kHeadDimV + kStats) * 4);
    static_assert(Config::kSmemBytes == Config::kSmemQBytes + (Config::kSmemRingBytes > Config::kSmemMergeBytes
                                                                   ? Config::kSmemRingBytes
                                                                   : Config::kSmemMergeBytes));

    static __device__ void run(const FagenFwdParams& p, char* smem) {
        const int tid = threadIdx.x;
        const int warp = tid / 32;
        const int lane = tid % 32;
        const int group = p.heads_q / p.heads_kv;
        const int row_blocks = (p.seqlen_q * group + kBlockM - 1) / kBlockM;
        const int kv_head = blockIdx.y / row_blocks;
        const int row_begin = (blockIdx.y % row_blocks) * kBlockM;
        const int batch = blockIdx.z;
        const algo::Sequence seq = algo::Sequence::of(p, batch);
        const int packed_rows = seq.seqlen_q * group;
        if (row_begin >= packed_rows) return;  // a packed batch row shorter than the longest
        const int rows_valid = min(kBlockM, packed_rows - row_begin);
        const int first_token = row_begin / group;
        const int last_token = (row_begin + rows_valid - 1) / group;

        // The key blocks the rows see, and this CTA's split of them.
        const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
        const algo::KeyBlocks band = mask.key_blocks(first_token, last_token - first_token + 1, kBlockN);
        const int band_blocks = max(band.count(), 0);
        const int per_split = (band_blocks + p.num_splits - 1) / p.num_splits;
        const int split_begin = band.begin + blockIdx.x * per_split;
        const int split_blocks = max(0, min(band.begin + band_blocks, split_begin + per_split) - split_begin);
        const int warp_blocks = split_blocks > warp ? (split_blocks - warp + kWarps - 1) / kWarps : 0;

        const uint32_t smem_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
        const uint32_t ring = smem_q + Config::kSmemQBytes + warp * kStages * Config::kSmemWarpStageBytes;

        // Q's packed rows, by the whole CTA (the oldest cp.async group of every thread).
        const Element* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride;
        constexpr int kQVecs = Config::kHeadDim / 8;
        for (int idx = tid; idx < kBlockM * kQVecs; idx += Config::kThreads) {
            const int r = idx / kQVecs;
            const bool valid = r < rows_valid;
            const int row = row_begin + (valid ? r : 0);
            const Element* src = q + (seq.q_begin + row / group) * p.q_row_stride +
                                 (kv_head * group + row % group) * p.q_head_stride + (idx % kQVecs) * 8;
            ptx::cp_async_cg_16(smem_q + r * kPitch + (idx % kQVecs) * 16, src, valid);
        }
        ptx::cp_async_commit_group();

        const Element* k = static_cast<const Element*>(p.k) + kv_head * p.k_head_stride;
        const Element* v = static_cast<const Element*>(p.v) + kv_head * p.v_head_stride;
        auto key_of = [&](int i) { return (split_begin + warp + i * kWarps) * kBlockN; };
        auto k_slot = [&](int i) { return ring + (i % kStages) * Config::kSmemWarpStageBytes; };
        auto v_slot = [&](int i) { return k_slot(i) + kBlockN * kPitch; };
        // This warp's i-th key block into its slot; keys past the row's length (and a page the
        // block table does not have) are zeros, which the mask (or nothing) then sees.
        auto load = [&](int i) {
            const int key = key_of(i);
            const int rows = seq.seqlen_k - key;
            const Element* k_rows = algo::cache_rows(p, k, p.k_batch_stride, p.k_row_stride, batch, key);
            const Element* v_rows = algo::cache_rows(p, v, p.v_batch_stride, p.v_row_stride, batch, key);
            algo::load_rows<Element, kBlockN, Config::kHeadDim, kPitch, 32>(
                k_slot(i), k_rows != nullptr ? k_rows : k, p.k_row_stride, k_rows != nullptr ? rows : 0, lane);
            algo::load_rows<Element, kBlockN, Config::kHeadDimV, kVPitch, 32>(
                v_slot(i), v_rows != nullptr ? v_rows : v, p.v_row_stride, v_rows != nullptr ? rows : 0, lane);
        };
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) {
            if (i < warp_blocks) load(i);
            ptx::cp_async_commit_group();  // one group per slot, empty or not: counts stay exact
        }
        // Q has landed for every thread before any warp reads it.
        ptx::cp_async_wait_group<kStages - 1>();
        __syncthreads();

        // This lane's two rows of the m16 tile (algo/fragment.cuh): their tokens and heads.
        int token[2], head[2];
        Score score[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = lane / 4 + 8 * h;
            const int row = row_begin + (r < rows_valid ? r : 0);
            token[h] = row / group;
            head[h] = kv_head * group + row % group;
            score[h] = Score::of(p, batch, head[h]);
            score[h].causal_offset = seq.seqlen_k - seq.seqlen_q;
        }

        const uint32_t q_lane = (lane % 16) * kPitch + (lane / 16) * 16;
        const uint32_t k_lane = (lane % 8 + 8 * (lane / 16)) * kPitch + ((lane / 8) % 2) * 16;
        const uint32_t v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kVPitch + (lane / 16) * 16;

        float acc_o[1][kOTiles][4];
        algo::clear_fragment(acc_o);
        algo::OnlineSoftmax<1, Ops> softmax;
        softmax.init();

        for (int i = 0; i < warp_blocks; ++i) {
            ptx::cp_async_wait_group<kStages - 2>();
            // Block i has landed for every lane, and every lane is done with block i - 1, whose
            // slot the next load overwrites.
            __syncwarp();
            if (i + kStages - 1 < warp_blocks) load(i + kStages - 1);
            ptx::cp_async_commit_group();

            float acc_s[1][kSTiles][4];
            algo::clear_fragment(acc_s);
#pragma unroll
            for (int kk = 0; kk < kQKSteps; ++kk) {
                uint32_t a[4];
                ptx::ldmatrix_x4(a, smem_q + q_lane + kk * 32);
#pragma unroll
                for (int np = 0; np < kSTiles / 2; ++np) {
                    uint32_t b[4];
                    ptx::ldmatrix_x4(b, k_slot(i) + k_lane + np * 16 * kPitch + kk * 32);
                    const uint32_t b_lo[2] = {b[0], b[1]};
                    const uint32_t b_hi[2] = {b[2], b[3]};
                    Ops::mma(acc_s[0][2 * np], a, b_lo);
                    Ops::mma(acc_s[0][2 * np + 1], a, b_hi);
                }
            }

            const int key = key_of(i);
            if constexpr (!Score::kIdentity) {
#pragma unroll
                for (int n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e / 2;
                        acc_s[0][n][e] = score[h].modify(acc_s[0][n][e], token[h],
                                                         key + algo::fragment_coord(lane, 0, n, e).col);
                    }
            }
            if (mask.block_needs_mask(key / kBlockN, first_token, last_token - first_token + 1, kBlockN)) {
#pragma unroll
                for (int n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (mask.masked(token[e / 2], key + algo::fragment_coord(lane, 0, n, e).col)) {
                            acc_s[0][n][e] = algo::neg_inf();
                        }
                    }
            }
            softmax.step(acc_s, acc_o, p.scale_log2);

#pragma unroll
            for (int kk = 0; kk < kPVSteps; ++kk) {
                uint32_t a[4];
                algo::pack_a_fragment<Element>(a, acc_s[0], kk);
#pragma unroll
                for (int dp = 0; dp < kOTiles / 2; ++dp) {
                    uint32_t b[4];
                    ptx::ldmatrix_x4_trans(b, v_slot(i) + v_lane + kk * 16 * kVPitch + dp * 32);
                    const uint32_t b_lo[2] = {b[0], b[1]};
                    const uint32_t b_hi[2] = {b[2], b[3]};
                    Ops::mma(acc_o[0][2 * dp], a, b_lo);
                    Ops::mma(acc_o[0][2 * dp + 1], a, b_hi);
                }
            }
        }
        ptx::cp_async_wait_group<0>();
        merge_and_store(p, smem, acc_o, softmax, seq, batch, kv_head, group, row_begin, rows_valid);
    }

    // The warps' states of the same 16 rows, each against its own maximum, into one: through
    // shared memory over the rings, which every warp is done with after the barrier.
    static __device__ __forceinline__ void merge_and_store(const FagenFwdParams& p, char* smem,
                                                           const float (&acc_o)[1][kOTiles][4],
                                                           const algo::OnlineSoftmax<1, Ops>& softmax,
                                                           const algo::Sequence& seq, int batch, int kv_head,
                                                           int group, int row_begin, int rows_valid) {
        const int tid = threadIdx.x;
        const int warp = tid / 32;
        const int lane = tid % 32;
        float* merge_o = reinterpret_cast<float*>(smem + Config::kSmemQBytes);  // [warp][row][kHeadDimV]
        float* merge_stat = merge_o + kWarps * kBlockM * Config::kHeadDimV;      // [warp][row][kStats]
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = algo::quad_sum(softmax.row_sum[0][h]);
            const float top = algo::reference_scaled(softmax.row_max[0][h], p.scale_log2);
            // round16(P) - P of the key at the warp's maximum (algo/online_softmax.cuh: O is exact
            // for the key that dominates a row, as P V saw it).
            const float rounding = sum == 0.f ? 0.f : algo::operand_rounding<Ops>(softmax.row_max[0][h], p.scale_log2, top);
            if (lane % 4 == 0) {
                float* stat = merge_stat + (warp * kBlockM + lane / 4 + 8 * h) * kStats;
                stat[0] = top;
                stat[1] = sum;
                stat[2] = rounding;
            }
        }
        algo::for_each_pair(acc_o, lane, [&](algo::FragmentCoord c, float lo, float hi) {
            *reinterpret_cast<float2*>(merge_o + (warp * kBlockM + c.row) * Config::kHeadDimV + c.col) =
                make_float2(lo, hi);
        });
        __syncthreads();

        constexpr int kVecs = Config::kHeadDimV / 4;  // 4 columns per thread and step
        const long long partial_rows = static_cast<long long>(p.batch) * p.seqlen_q;
        for (int idx = tid; idx < kBlockM * kVecs; idx += Config::kThreads) {
            const int r = idx / kVecs;
            const int col = (idx % kVecs) * 4;
            if (r >= rows_valid) break;  // rows ascend with idx
            float top = algo::neg_inf();
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float* stat = merge_stat + (w * kBlockM + r) * kStats;
                if (stat[1] > 0.f) top = fmaxf(top, stat[0]);
            }
            float sum = 0.f, divisor = 0.f;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float* stat = merge_stat + (w * kBlockM + r) * kStats;
                if (stat[1] > 0.f) {
                    const float f = ptx::ex2_approx_ftz(stat[0] - top);
                    sum = fmaf(f, stat[1], sum);
                    divisor = fmaf(f, stat[1] + stat[2], divisor);
                    const float4 x = *reinterpret_cast<const float4*>(merge_o + (w * kBlockM + r) * Config::kHeadDimV + col);
                    o = make_float4(fmaf(f, x.x, o.x), fmaf(f, x.y, o.y), fmaf(f, x.z, o.z), fmaf(f, x.w, o.w));
                }
            }
            const int row = row_begin + r;
            const int token = row / group;
            const int head = kv_head * group + row % group;
            const float keys_top = sum == 0.f ? 0.f : top;
            if (p.num_splits == 1) {
                float inv, lse;
                if constexpr (Config::kSinks) {
                    const algo::SinkTerm t = algo::sink_term(sum, keys_top, algo::head_sink_log2(p, head));
                    inv = t.keys / fmaf(divisor, t.keys, t.sink);
                    lse = algo::natural_lse(t.top, fmaf(sum, t.keys, t.sink));
                } else {
                    inv = algo::inverse_row_sum(divisor);
                    lse = algo::natural_lse(keys_top, sum);
                }
                Element* out = static_cast<Element*>(p.o) + batch * p.o_batch_stride +
                               (seq.q_begin + token) * p.o_row_stride + head * p.o_head_stride + col;
                *reinterpret_cast<uint2*>(out) = make_uint2(Ops::pack(o.x * inv, o.y * inv), Ops::pack(o.z * inv, o.w * inv));
                if (col == 0 && p.lse != nullptr) {
                    p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin + token] = lse;
                }
            } else {
                // Sinks join in the combine: a partial LSE is its keys' only.
                const float inv = algo::inverse_row_sum(divisor);
                const long long partial_row = blockIdx.x * partial_rows + seq.partial_begin + token;
                *reinterpret_cast<float4*>(p.o_partial + (partial_row * p.heads_q + head) * Config::kHeadDimV + col) =
                    make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
                if (col == 0) {
                    p.lse_partial[(blockIdx.x * p.heads_q + head) * partial_rows + seq.partial_begin + token] =
                        algo::natural_lse(keys_top, sum);
                }
            }
        }
    }

    // The combine entry point: a warp per (partial row, query head) merges the num_splits
    // partial results (each normalised, with its LSE) into O and LSE; the sink, where the kernel
    // has one, joins the denominator here.
    static __device__ void combine(const FagenFwdParams& p) {
        const int warp = threadIdx.x / 32;
        const int lane = threadIdx.x % 32;
        const long long partial_rows = static_cast<long long>(p.batch) * p.seqlen_q;
        const long long index = static_cast<long long>(blockIdx.x) * Config::kCompanionRowsPerCta + warp;
        if (index >= partial_rows * p.heads_q) return;
        const int row = static_cast<int>(index / p.heads_q);
        const int head = static_cast<int>(index % p.heads_q);
        int batch = 0, token = row;  // packed: the row is the token's row in o (batch strides 0)
        if (p.cu_seqlens_q != nullptr) {
            if (row >= p.cu_seqlens_q[p.batch]) return;  // past the packed tokens
        } else {
            batch = row / p.seqlen_q;
            token = row % p.seqlen_q;
        }
        auto partial_lse = [&](int split) { return p.lse_partial[(split * p.heads_q + head) * partial_rows + row]; };

        float top = algo::neg_inf();
        for (int s = lane; s < p.num_splits; s += 32) top = fmaxf(top, partial_lse(s));
        top = warp_max(top);
        const float sink = Config::kSinks ? p.sinks[head] : algo::neg_inf();
        const float reference = fmaxf(top, sink);
        float lse = algo::neg_inf();
        if (reference != algo::neg_inf()) {
            float sum = 0.f;
            for (int s = lane; s < p.num_splits; s += 32) sum += __expf(partial_lse(s) - reference);
            sum = warp_sum(sum);
            if constexpr (Config::kSinks) sum += __expf(sink - reference);
            lse = reference + __logf(sum);
        }

        constexpr int kPairs = (Config::kHeadDimV + 63) / 64;  // column pairs per lane
        float2 acc[kPairs];
#pragma unroll
        for (int c = 0; c < kPairs; ++c) acc[c] = make_float2(0.f, 0.f);
        if (lse != algo::neg_inf()) {
            for (int s = 0; s < p.num_splits; ++s) {
                const float l = partial_lse(s);
                if (l == algo::neg_inf()) continue;  // a split that saw no key
                const float w = __expf(l - lse);
                const float* part = p.o_partial + ((s * partial_rows + row) * p.heads_q + head) * Config::kHeadDimV;
#pragma unroll
                for (int c = 0; c < kPairs; ++c) {
                    const int col = 2 * lane + 64 * c;
                    if (col < Config::kHeadDimV) {
                        const float2 x = *reinterpret_cast<const float2*>(part + col);
                        acc[c] = make_float2(fmaf(w, x.x, acc[c].x), fmaf(w, x.y, acc[c].y));
                    }
                }
            }
        }
        Element* out = static_cast<Element*>(p.o) + batch * p.o_batch_stride + token * p.o_row_stride +
                       head * p.o_head_stride;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
            const int col = 2 * lane + 64 * c;
            if (col < Config::kHeadDimV) *reinterpret_cast<uint32_t*>(out + col) = Ops::pack(acc[c].x, acc[c].y);
        }
        if (lane == 0 && p.lse != nullptr) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
    }
};

}  // namespace fagen::fa2
