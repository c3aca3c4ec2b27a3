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
//
// An e4m3 cache (Config::CacheElement; fp16 or bf16 queries) moves half the bytes: its K and V
// rows land in shared memory as they are and widen to fp16 in registers, exactly, by moving
// bits (ElementOps<__half>::widen_e4m3: the value times 2^-8), on their way into fp16 mma.sync,
// whatever the queries' type: bf16's widening would need one more multiplication per pair,
// 8 % of the decode's time (H200, 2026-12-04). bf16 queries then enter shared memory as fp16,
// times a power of two that puts the CTA's largest |q| in [2^14, 2^15) (exact for every value
// within 2^-24 of it), and P is fp16 (probabilities in [0, 1]); the output is the queries' type.
// An ldmatrix of e4m3 K rows gives a lane four neighbouring head-dim columns of one key, of which
// the widening pairs the first and third (and the second and fourth): Q's columns sit in shared
// memory in the same pairing (each 16-column chunk's even columns, then its odd ones), so Q K^T
// sums the same products. V's transposing
// ldmatrix moves byte pairs: a lane gets two keys' values at two neighbouring columns, which
// widen into the B operands of an n8 tile of even columns and one of odd columns, so O's
// accumulator holds each 16-column chunk's even columns, then its odd ones, until the merge.
// The descales (and the widening's power of two) scale the scores and O once per CTA: one
// (batch row, K/V head).
#pragma once
#include "fagen/types.cuh"

#include "fagen/algo/descale.cuh"
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
    using Element = typename Config::Element;            // Q's and the output's
    using CacheElement = typename Config::CacheElement;  // K's and V's
    static constexpr bool kE4m3Cache = sizeof(CacheElement) == 1;
    static constexpr bool kQInComputeType = !kE4m3Cache || !Config::kIsBf16;  // Q enters shared memory as it is
    using Compute = typename Pick<kE4m3Cache, __half, Element>::type;  // the mma's operands and P
    using Ops = algo::ElementOps<Compute>;
    using OutOps = algo::ElementOps<Element>;
    using Mask = typename Config::Mask;
    using Score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>;

    static constexpr int kBlockM = Config::kBlockM;
    static constexpr int kBlockN = Config::kBlockN;
    static constexpr int kLookupRows = Config::kLookupRows;
    static constexpr int kWarps = Config::kWarps;
    static constexpr int kStages = Config::kStages;
    static constexpr int kQPitch = Config::kQRowPitchBytes;  // Q rows
    static constexpr int kPitch = Config::kRowPitchBytes;    // K rows
    static constexpr int kVPitch = Config::kVRowPitchBytes;  // V rows
    static constexpr int kSTiles = kBlockN / 8;               // n8 tiles of S
    static constexpr int kOTiles = Config::kHeadDimV / 8;     // n8 tiles of O
    static constexpr int kQKSteps = Config::kHeadDim / 16;
    static constexpr int kPVSteps = kBlockN / 16;
    static constexpr int kStats = 3;  // per merged row and warp: scaled maximum, sum, operand rounding
    // An e4m3 cache's widened values are its stored ones times this (ElementOps::widen_e4m3).
    static constexpr float kWidenedUnit = 1.f / static_cast<float>(1 << -algo::ElementOps<__half>::kWidenedE4m3Log2);

    static_assert(kBlockM == 16, "one m16 tile of packed rows, shared by every warp");
    static_assert(Config::kMask == algo::MaskKind::kLocal, "the band serves full and causal too");
    static_assert(kBlockN % 16 == 0 && Config::kHeadDim % 16 == 0 && Config::kHeadDimV % 16 == 0);
    static_assert(kBlockN % kLookupRows == 0);
    static_assert(!kE4m3Cache || (Config::kHeadDim % 32 == 0 && Config::kHeadDimV % 32 == 0),
                  "e4m3 rows: an ldmatrix.x4 takes two 16-column chunks of 16 keys");
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

        // Q's packed rows, by the whole CTA (the oldest cp.async group of every thread; an e4m3
        // cache's go through registers once the ring's first loads are in flight).
        const Element* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride;
        auto q_row = [&](int r) {
            const int row = row_begin + r;
            return q + (seq.q_begin + row / group) * p.q_row_stride + (kv_head * group + row % group) * p.q_head_stride;
        };
        if constexpr (!kE4m3Cache) {
            constexpr int kQVecs = Config::kHeadDim / 8;
            for (int idx = tid; idx < kBlockM * kQVecs; idx += Config::kThreads) {
                const int r = idx / kQVecs;
                const bool valid = r < rows_valid;
                ptx::cp_async_cg_16(smem_q + r * kQPitch + (idx % kQVecs) * 16, q_row(valid ? r : 0) + (idx % kQVecs) * 8,
                                    valid);
            }
        }
        ptx::cp_async_commit_group();

        const CacheElement* k = static_cast<const CacheElement*>(p.k) + kv_head * p.k_head_stride;
        const CacheElement* v = static_cast<const CacheElement*>(p.v) + kv_head * p.v_head_stride;
        auto key_of = [&](int i) { return (split_begin + warp + i * kWarps) * kBlockN; };
        auto k_slot = [&](int i) { return ring + (i % kStages) * Config::kSmemWarpStageBytes; };
        auto v_slot = [&](int i) { return k_slot(i) + kBlockN * kPitch; };
        // This warp's i-th key block into its slot; keys past the row's length (and a page the
        // block table does not have) are zeros, which the mask (or nothing) then sees.
        // A block looks its pages up in runs of kLookupRows keys, which no page size splits. The
        // warp's runs are numbered in load order (block i's are i * kRuns ...); each lane holds
        // the page of one of the next 32, read together: one load a lane per 32 runs instead of
        // a dependent load before every run's copies. Runs from the row's length on read no
        // entry (past the block table's row) and load no rows.
        constexpr int kRuns = kBlockN / kLookupRows;
        int lane_page = -1, pages_first = -32;
        auto page_of = [&](int run) {
            if (p.block_table == nullptr) return 0;
            if (run >= pages_first + 32) {  // warp-uniform: every lane loads the same runs
                pages_first = run;
                const int mine = run + lane;
                const int key = key_of(mine / kRuns) + (mine % kRuns) * kLookupRows;
                lane_page = key < seq.seqlen_k ? algo::cache_page(p, batch, key) : -1;
            }
            return __shfl_sync(0xffffffffu, lane_page, run - pages_first);
        };
        auto load = [&](int i) {
#pragma unroll
            for (int run = 0; run < kRuns; ++run) {
                const int key = key_of(i) + run * kLookupRows;
                const int rows = seq.seqlen_k - key;
                const int page = page_of(i * kRuns + run);
                const CacheElement* k_rows =
                    algo::page_rows(p, k, p.k_batch_stride, p.k_row_stride, batch, page, key);
                const CacheElement* v_rows =
                    algo::page_rows(p, v, p.v_batch_stride, p.v_row_stride, batch, page, key);
                algo::load_rows<CacheElement, kLookupRows, Config::kHeadDim, kPitch, 32>(
                    k_slot(i) + run * kLookupRows * kPitch, k_rows != nullptr ? k_rows : k, p.k_row_stride,
                    k_rows != nullptr ? rows : 0, lane);
                algo::load_rows<CacheElement, kLookupRows, Config::kHeadDimV, kVPitch, 32>(
                    v_slot(i) + run * kLookupRows * kVPitch, v_rows != nullptr ? v_rows : v, p.v_row_stride,
                    v_rows != nullptr ? rows : 0, lane);
            }
        };
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) {
            if (i < warp_blocks) load(i);
            ptx::cp_async_commit_group();  // one group per slot, empty or not: counts stay exact
        }
        float q_unscale = 1.f;  // what the scores of the fp16 Q in shared memory are multiplied by
        if constexpr (kE4m3Cache) q_unscale = store_q_fp16(smem, rows_valid, q_row);
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
        // The scores' scale: the call's, with an e4m3 cache times the descales of this (batch
        // row, K/V head) and the widening's power of two. A softcap takes the scores' factor in
        // its own scale (scale_log2 then scales the capped values), else scale_log2 and the
        // ALiBi slope (in score units) take it. O's scale waits for the merge (one register
        // less through the loop).
        float scale_log2 = p.scale_log2;
        if constexpr (kE4m3Cache) {
            const float score_factor =
                algo::descale(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride, batch, kv_head) *
                algo::descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, batch, kv_head) /
                kWidenedUnit * q_unscale;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (Config::kSoftcap) {
                    score[h].softcap_scale *= score_factor;
                } else if constexpr (Config::kAlibi) {
                    score[h].alibi_slope /= score_factor;
                }
            }
            if constexpr (!Config::kSoftcap) scale_log2 *= score_factor;
        }

        const uint32_t q_lane = (lane % 16) * kQPitch + (lane / 16) * 16;
        // 16-bit K: matrices (keys 0-7, columns 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) of a
        // k-step; e4m3 K: (keys 0-7, step kk), (8-15, kk), (0-7, kk + 1), (8-15, kk + 1).
        const uint32_t k_lane = kE4m3Cache ? (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + (lane / 16) * 16
                                           : (lane % 8 + 8 * (lane / 16)) * kPitch + ((lane / 8) % 2) * 16;
        // 16-bit V (transposed): (keys 0-7, columns 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15);
        // e4m3 V: the same over column pairs, so 16-column chunks instead of 8.
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
            if constexpr (kE4m3Cache) {
#pragma unroll
                for (int kk = 0; kk < kQKSteps; kk += 2) {
                    // b[np][2 step]: keys 16 np .. 16 np + 7 of step kk + step; b[np][2 step + 1]: the next 8.
                    uint32_t b[kSTiles / 2][4];
#pragma unroll
                    for (int np = 0; np < kSTiles / 2; ++np) {
                        ptx::ldmatrix_x4(b[np], k_slot(i) + k_lane + np * 16 * kPitch + kk * 16);
                    }
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
                        uint32_t a[4];
                        ptx::ldmatrix_x4(a, smem_q + q_lane + (kk + step) * 32);
#pragma unroll
                        for (int np = 0; np < kSTiles / 2; ++np)
#pragma unroll
                            for (int n = 0; n < 2; ++n) {
                                const uint32_t wide[2] = {Ops::template widen_e4m3<false>(b[np][2 * step + n]),
                                                          Ops::template widen_e4m3<true>(b[np][2 * step + n])};
                                Ops::mma(acc_s[0][2 * np + n], a, wide);
                            }
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < kQKSteps; ++kk) {
                    uint32_t a[4];
                    ptx::ldmatrix_x4(a, smem_q + q_lane + kk * 32);
#pragma unroll
                    for (int np = 0; np < kSTiles / 2; ++np) {
                        uint32_t b[4];
                        ptx::ldmatrix_x4(b, k_slot(i) + k_lane + np * 16 * kPitch + kk * 32);
                        algo::mma_two_n8<Ops>(acc_s[0][2 * np], acc_s[0][2 * np + 1], a, b);
                    }
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
            softmax.step(acc_s, acc_o, scale_log2);

#pragma unroll
            for (int kk = 0; kk < kPVSteps; ++kk) {
                uint32_t a[4];
                algo::pack_a_fragment<Compute>(a, acc_s[0], kk);
                if constexpr (kE4m3Cache) {
#pragma unroll
                    for (int cp = 0; cp < Config::kHeadDimV / 32; ++cp) {  // pairs of 16-column chunks
                        uint32_t b[4];
                        ptx::ldmatrix_x4_trans(b, v_slot(i) + v_lane + kk * 16 * kVPitch + cp * 32);
#pragma unroll
                        for (int c = 0; c < 2; ++c) {  // b[2c]: keys 0-7 of chunk 2cp + c; b[2c + 1]: 8-15
                            const uint32_t even[2] = {Ops::template widen_e4m3<false>(b[2 * c]),
                                                      Ops::template widen_e4m3<false>(b[2 * c + 1])};
                            const uint32_t odd[2] = {Ops::template widen_e4m3<true>(b[2 * c]),
                                                     Ops::template widen_e4m3<true>(b[2 * c + 1])};
                            Ops::mma(acc_o[0][4 * cp + 2 * c], a, even);
                            Ops::mma(acc_o[0][4 * cp + 2 * c + 1], a, odd);
                        }
                    }
                } else {
#pragma unroll
                    for (int dp = 0; dp < kOTiles / 2; ++dp) {
                        uint32_t b[4];
                        ptx::ldmatrix_x4_trans(b, v_slot(i) + v_lane + kk * 16 * kVPitch + dp * 32);
                        algo::mma_two_n8<Ops>(acc_o[0][2 * dp], acc_o[0][2 * dp + 1], a, b);
                    }
                }
            }
        }
        ptx::cp_async_wait_group<0>();
        const float output_scale =
            kE4m3Cache
                ? algo::descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, batch, kv_head) /
                      kWidenedUnit
                : 1.f;
        merge_and_store(p, smem, acc_o, softmax, seq, batch, kv_head, group, row_begin, rows_valid, scale_log2,
                        output_scale);
    }

    // An e4m3 cache's Q: the CTA's rows as fp16 in shared memory, each 16-column chunk as its
    // even columns, then its odd ones (the pairing of widen_e4m3; see the top), bf16 rows times
    // the power of two that puts the CTA's largest |q| in [2^14, 2^15) (the per-warp maxima
    // meet after the rows, kQMaximaOffset). Returns that power's inverse.
    template <class QRow>
    static __device__ __forceinline__ float store_q_fp16(char* smem, int rows_valid, const QRow& q_row) {
        constexpr int kChunks = Config::kHeadDim / 16;
        constexpr int kPerThread = (kBlockM * kChunks + Config::kThreads - 1) / Config::kThreads;
        const int tid = threadIdx.x;
        uint4 chunk_lo[kPerThread], chunk_hi[kPerThread];
        float top = 0.f;
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int idx = tid + j * Config::kThreads;
            const int r = idx / kChunks;
            chunk_lo[j] = chunk_hi[j] = make_uint4(0, 0, 0, 0);
            if (idx < kBlockM * kChunks && r < rows_valid) {
                const uint4* src = reinterpret_cast<const uint4*>(q_row(r) + (idx % kChunks) * 16);
                chunk_lo[j] = src[0];
                chunk_hi[j] = src[1];
            }
            if constexpr (!kQInComputeType) {
                const uint32_t words[8] = {chunk_lo[j].x, chunk_lo[j].y, chunk_lo[j].z, chunk_lo[j].w,
                                           chunk_hi[j].x, chunk_hi[j].y, chunk_hi[j].z, chunk_hi[j].w};
#pragma unroll
                for (int w = 0; w < 8; ++w) {
                    const float2 x = OutOps::unpack(words[w]);
                    top = fmaxf(top, fmaxf(fabsf(x.x), fabsf(x.y)));
                }
            }
        }
        float scale = 1.f;
        if constexpr (!kQInComputeType) {
            float* maxima = reinterpret_cast<float*>(smem + Config::kQMaximaOffset);
            top = warp_max(top);
            if (tid % 32 == 0) maxima[tid / 32] = top;
            __syncthreads();
#pragma unroll
            for (int w = 0; w < kWarps; ++w) top = fmaxf(top, maxima[w]);
            if (top > 0.f) scale = exp2f(static_cast<float>(14 - ilogbf(top)));  // exact: a power of two
        }
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int idx = tid + j * Config::kThreads;
            if (idx >= kBlockM * kChunks) break;
            const uint32_t in[8] = {chunk_lo[j].x, chunk_lo[j].y, chunk_lo[j].z, chunk_lo[j].w,
                                    chunk_hi[j].x, chunk_hi[j].y, chunk_hi[j].z, chunk_hi[j].w};
            uint32_t words[8];
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                if constexpr (kQInComputeType) {
                    words[w] = in[w];
                } else {
                    const float2 x = OutOps::unpack(in[w]);
                    words[w] = Ops::pack(x.x * scale, x.y * scale);
                }
            }
            uint4* dst = reinterpret_cast<uint4*>(smem + (idx / kChunks) * kQPitch + (idx % kChunks) * 32);
            dst[0] = make_uint4(__byte_perm(words[0], words[1], 0x5410), __byte_perm(words[2], words[3], 0x5410),
                                __byte_perm(words[4], words[5], 0x5410), __byte_perm(words[6], words[7], 0x5410));
            dst[1] = make_uint4(__byte_perm(words[0], words[1], 0x7632), __byte_perm(words[2], words[3], 0x7632),
                                __byte_perm(words[4], words[5], 0x7632), __byte_perm(words[6], words[7], 0x7632));
        }
        return 1.f / scale;
    }

    // The warps' states of the same 16 rows, each against its own maximum, into one: through
    // shared memory over the rings, which every warp is done with after the barrier.
    static __device__ __forceinline__ void merge_and_store(const FagenFwdParams& p, char* smem,
                                                           const float (&acc_o)[1][kOTiles][4],
                                                           const algo::OnlineSoftmax<1, Ops>& softmax,
                                                           const algo::Sequence& seq, int batch, int kv_head,
                                                           int group, int row_begin, int rows_valid,
                                                           float scale_log2, float output_scale) {
        const int tid = threadIdx.x;
        const int warp = tid / 32;
        const int lane = tid % 32;
        float* merge_o = reinterpret_cast<float*>(smem + Config::kSmemQBytes);  // [warp][row][kHeadDimV]
        float* merge_stat = merge_o + kWarps * kBlockM * Config::kHeadDimV;      // [warp][row][kStats]
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = algo::quad_sum(softmax.row_sum[0][h]);
            const float top = algo::reference_scaled(softmax.row_max[0][h], scale_log2);
            // round16(P) - P of the key at the warp's maximum (algo/online_softmax.cuh: O is exact
            // for the key that dominates a row, as P V saw it).
            const float rounding = sum == 0.f ? 0.f : algo::operand_rounding<Ops>(softmax.row_max[0][h], scale_log2, top);
            if (lane % 4 == 0) {
                float* stat = merge_stat + (warp * kBlockM + lane / 4 + 8 * h) * kStats;
                stat[0] = top;
                stat[1] = sum;
                stat[2] = rounding;
            }
        }
        algo::for_each_pair(acc_o, lane, [&](algo::FragmentCoord c, float lo, float hi) {
            float* o_row = merge_o + (warp * kBlockM + c.row) * Config::kHeadDimV;
            if constexpr (kE4m3Cache) {
                // Tile 2j holds chunk j's even columns, tile 2j + 1 its odd ones (see the top).
                const int tile = c.col / 8;
                const int col = 16 * (tile / 2) + 2 * (c.col % 8) + tile % 2;
                o_row[col] = lo;
                o_row[col + 2] = hi;
            } else {
                *reinterpret_cast<float2*>(o_row + c.col) = make_float2(lo, hi);
            }
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
                    inv = output_scale * t.keys / fmaf(divisor, t.keys, t.sink);
                    lse = algo::natural_lse(t.top, fmaf(sum, t.keys, t.sink));
                } else {
                    inv = output_scale * algo::inverse_row_sum(divisor);
                    lse = algo::natural_lse(keys_top, sum);
                }
                Element* out = static_cast<Element*>(p.o) + batch * p.o_batch_stride +
                               (seq.q_begin + token) * p.o_row_stride + head * p.o_head_stride + col;
                *reinterpret_cast<uint2*>(out) = make_uint2(OutOps::pack(o.x * inv, o.y * inv), OutOps::pack(o.z * inv, o.w * inv));
                if (col == 0 && p.lse != nullptr) {
                    p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_begin + token] = lse;
                }
            } else {
                // Sinks join in the combine: a partial LSE is its keys' only.
                const float inv = output_scale * algo::inverse_row_sum(divisor);
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
            if (col < Config::kHeadDimV) *reinterpret_cast<uint32_t*>(out + col) = OutOps::pack(acc[c].x, acc[c].y);
        }
        if (lane == 0 && p.lse != nullptr) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
    }
};

}  // namespace fagen::fa2
