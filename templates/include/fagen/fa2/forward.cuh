// FlashAttention-2 forward on mma.sync (sm_80 and later).
//
// One CTA per (query block, head, batch). The Q tile is copied to shared memory once; K/V tiles
// stream through a ring of Config::kStages shared-memory slots filled by cp.async, so block j+1..
// j+kStages-1 load while block j computes. With kStages == 1 the one K and one V buffer take
// turns instead (FlashAttention-2's own schedule): V_j loads during Q K_j^T, K_{j+1} during the
// softmax and P V_j, at half the shared memory of two stages. Each warp owns kWarpRows query rows (1 or 2 m16
// tiles): S = Q K^T and O += P V run on mma.sync.m16n8k16 with fp32 accumulation, operands
// fetched by ldmatrix; P stays in registers between the two MMAs. Key blocks are visited last
// to first, so the (at most two) blocks that need masking come first and the rest run unmasked.
// Dense or varlen (Config::kVarlen: algo/batch_row.cuh).
#pragma once
#include "fagen/types.cuh"

#include "fagen/algo/batch_row.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/online_softmax.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/smem_rows.cuh"
#include "fagen/algo/tile_output.cuh"
#include "fagen/algo/tile_scheduler.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"
#include "fagen/ptx/cp_async.cuh"
#include "fagen/ptx/ldmatrix.cuh"

namespace fagen::fa2 {

template <class Config>
struct Forward {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;

    static constexpr int kThreads = Config::kThreads;
    static constexpr int kPitch = Config::kRowPitchBytes;     // Q and K rows (and O's staging)
    static constexpr int kVPitch = Config::kVRowPitchBytes;   // V rows
    static constexpr int kOVecsPerRow = Config::kHeadDimV / 8;  // 16-byte vectors per O row
    static constexpr int kMTiles = Config::kWarpRows / 16;    // m16 tiles per warp
    static constexpr int kSTiles = Config::kBlockN / 8;       // n8 tiles of S
    static constexpr int kOTiles = Config::kHeadDimV / 8;     // n8 tiles of O
    static constexpr int kQKSteps = Config::kHeadDim / 16;    // k16 steps of Q K^T
    static constexpr int kPVSteps = Config::kBlockN / 16;     // k16 steps of P V

    static_assert(Config::kWarpRows % 16 == 0, "a warp owns whole m16 tiles");
    static_assert(Config::kHeadDim % 16 == 0 && Config::kHeadDimV % 16 == 0 && Config::kBlockN % 16 == 0,
                  "ldmatrix.x4 loads operand pairs of 16 columns");
    static_assert(kPitch % 16 == 0 && (kPitch / 16) % 2 == 1 && kVPitch % 16 == 0 && (kVPitch / 16) % 2 == 1,
                  "an odd number of 16-byte vectors per row keeps ldmatrix conflict-free");
    static_assert(Config::kHeadDimV <= Config::kHeadDim, "O is staged through Q's rows");
    static_assert(Config::kStages >= 1);

    template <int kRows, int kCols = Config::kHeadDim, int kRowPitch = kPitch>
    static __device__ __forceinline__ void load_rows(uint32_t smem, const Element* src,
                                                     long long row_stride, int rows_valid,
                                                     int tid) {
        algo::load_rows<Element, kRows, kCols, kRowPitch, kThreads>(smem, src, row_stride,
                                                                    rows_valid, tid);
    }

    static __device__ void run(const FagenFwdParams& p, char* smem) {
        const int tid = threadIdx.x;
        const int warp = tid / 32;
        const int lane = tid % 32;
        const auto sched = algo::TileScheduler<Config::kMask, false>::for_params(p, Config::kBlockM);
        const algo::Tile tile = sched.tile(sched.first());
        const int m_block = tile.m_block;
        const int head = tile.head;
        const int batch = tile.batch;
        const int kv_head = head / (p.heads_q / p.heads_kv);
        const int row_begin = m_block * Config::kBlockM;
        const int warp_row = warp * Config::kWarpRows;  // first row of this warp in the block
        const auto seq = algo::BatchRow<Config::kVarlen>::of(p, batch);
        if (Config::kVarlen && row_begin >= seq.seqlen_q(p)) return;  // past its batch row's queries

        const auto mask = Config::Mask::of(p, batch, seq.seqlen_q(p), seq.seqlen_k(p));
        const auto score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>::of(p, batch, head, seq.seqlen_q(p),
                                                                                 seq.seqlen_k(p));
        const algo::KeyBlocks blocks = mask.key_blocks(row_begin, Config::kBlockM, Config::kBlockN);
        const int n_blocks = blocks.count();

        Element* o = algo::tile_output<Element>(p, batch, head, seq.q_begin() + row_begin);
        float* lse = algo::tile_lse(p, batch, head, seq.q_begin() + row_begin);
        const int rows_valid = seq.seqlen_q(p) - row_begin;

        if (n_blocks <= 0) {
            algo::write_empty_rows<Element, Config::kBlockM, Config::kHeadDimV, kThreads>(
                o, p.o_row_stride, lse, rows_valid, tid, Config::kSinks ? p.sinks[head] : algo::neg_inf());
            return;
        }

        const Element* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                           head * p.q_head_stride + (seq.q_begin() + row_begin) * p.q_row_stride;
        const Element* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                           kv_head * p.k_head_stride + seq.k_begin() * p.k_row_stride;
        const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                           kv_head * p.v_head_stride + seq.k_begin() * p.v_row_stride;

        const uint32_t smem_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
        const uint32_t smem_kv = smem_q + Config::kSmemQBytes;

        // K rows (head_dim columns) and V rows (head_dim_v) of the j-th visited block (block
        // blocks.end-1-j) into `dst`.
        auto key_begin_of = [&](int j) { return (blocks.end - 1 - j) * Config::kBlockN; };
        auto load_k = [&](uint32_t dst, int j) {
            const int key_begin = key_begin_of(j);
            load_rows<Config::kBlockN, Config::kHeadDim, kPitch>(
                dst, k + key_begin * p.k_row_stride, p.k_row_stride, seq.seqlen_k(p) - key_begin, tid);
        };
        auto load_v = [&](uint32_t dst, int j) {
            const int key_begin = key_begin_of(j);
            load_rows<Config::kBlockN, Config::kHeadDimV, kVPitch>(
                dst, v + key_begin * p.v_row_stride, p.v_row_stride, seq.seqlen_k(p) - key_begin, tid);
        };
        // Ring slot of the j-th visited block: its K rows, then its V rows.
        auto k_slot = [&](int j) {
            return smem_kv + (j % Config::kStages) * Config::kSmemKVStageBytes;
        };
        auto v_slot = [&](int j) { return k_slot(j) + Config::kBlockN * kPitch; };

        load_rows<Config::kBlockM>(smem_q, q, p.q_row_stride, rows_valid, tid);
        if constexpr (Config::kStages == 1) {
            load_k(k_slot(0), 0);
            ptx::cp_async_commit_group();
        } else {
#pragma unroll
            for (int j = 0; j < Config::kStages - 1; ++j) {
                if (j < n_blocks) {
                    load_k(k_slot(j), j);
                    load_v(v_slot(j), j);
                }
                ptx::cp_async_commit_group();  // one group per slot, empty or not: counts stay exact
            }
        }

        // Per-lane byte offsets of the ldmatrix row addresses (see ldmatrix.cuh / mma_sync.cuh):
        // Q as the A operand, K as B of Q K^T (non-transposed), V as B of P V (transposed).
        const uint32_t q_lane = (warp_row + lane % 16) * kPitch + (lane / 16) * 16;
        const uint32_t k_lane = (lane % 8 + 8 * (lane / 16)) * kPitch + ((lane / 8) % 2) * 16;
        const uint32_t v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kVPitch + (lane / 16) * 16;

        float acc_o[kMTiles][kOTiles][4];
        algo::clear_fragment(acc_o);
        algo::OnlineSoftmax<kMTiles, Ops, Config> softmax;  // Config carries the softmax options
        softmax.init();

        for (int j = 0; j < n_blocks; ++j) {
            if constexpr (Config::kStages == 1) {
                // K_j has landed for every thread, and every warp is done with V_{j-1}, whose
                // buffer V_j now fills while Q K_j^T runs.
                ptx::cp_async_wait_group<0>();
                __syncthreads();
                load_v(v_slot(j), j);
                ptx::cp_async_commit_group();
            } else {
                ptx::cp_async_wait_group<Config::kStages - 2>();
                // Block j has landed for every thread, and every warp is done with block j-1,
                // whose slot the next load overwrites.
                __syncthreads();
                if (j + Config::kStages - 1 < n_blocks) {
                    load_k(k_slot(j + Config::kStages - 1), j + Config::kStages - 1);
                    load_v(v_slot(j + Config::kStages - 1), j + Config::kStages - 1);
                }
                ptx::cp_async_commit_group();
            }

            const int n_block = blocks.end - 1 - j;
            const uint32_t smem_k = k_slot(j);
            const uint32_t smem_v = v_slot(j);

            float acc_s[kMTiles][kSTiles][4];
            algo::clear_fragment(acc_s);

#pragma unroll
            for (int kk = 0; kk < kQKSteps; ++kk) {
                uint32_t a[kMTiles][4];
#pragma unroll
                for (int m = 0; m < kMTiles; ++m) {
                    ptx::ldmatrix_x4(a[m], smem_q + q_lane + m * 16 * kPitch + kk * 32);
                }
#pragma unroll
                for (int np = 0; np < kSTiles / 2; ++np) {
                    uint32_t b[4];
                    ptx::ldmatrix_x4(b, smem_k + k_lane + np * 16 * kPitch + kk * 32);
#pragma unroll
                    for (int m = 0; m < kMTiles; ++m) {
                        algo::mma_two_n8<Ops>(acc_s[m][2 * np], acc_s[m][2 * np + 1], a[m], b);
                    }
                }
            }

            if constexpr (Config::kStages == 1) {
                // V_j has landed, and every warp is done with K_j: K_{j+1} loads during the
                // softmax and P V_j.
                ptx::cp_async_wait_group<0>();
                __syncthreads();
                if (j + 1 < n_blocks) load_k(k_slot(j + 1), j + 1);
                ptx::cp_async_commit_group();
            }

            score.apply(acc_s, lane, row_begin + warp_row, n_block * Config::kBlockN);
            if (mask.block_needs_mask(n_block, row_begin + warp_row, Config::kWarpRows, Config::kBlockN)) {
                mask.apply(acc_s, lane, row_begin + warp_row, n_block * Config::kBlockN);
            }
            softmax.step(acc_s, acc_o, p.scale_log2);

#pragma unroll
            for (int kk = 0; kk < kPVSteps; ++kk) {
                uint32_t a[kMTiles][4];
#pragma unroll
                for (int m = 0; m < kMTiles; ++m) algo::pack_a_fragment<Element>(a[m], acc_s[m], kk);
#pragma unroll
                for (int dp = 0; dp < kOTiles / 2; ++dp) {
                    uint32_t b[4];
                    ptx::ldmatrix_x4_trans(b, smem_v + v_lane + kk * 16 * kVPitch + dp * 32);
#pragma unroll
                    for (int m = 0; m < kMTiles; ++m) {
                        algo::mma_two_n8<Ops>(acc_o[m][2 * dp], acc_o[m][2 * dp + 1], a[m], b);
                    }
                }
            }
        }
        ptx::cp_async_wait_group<0>();

        float row_lse[kMTiles][2];
        softmax.template finalize<Config::kSinks>(acc_o, row_lse, p.scale_log2,
                                                  Config::kSinks ? algo::head_sink_log2(p, head) : 0.f);
        store_output(acc_o, row_lse, smem, o, p.o_row_stride, lse, rows_valid, warp_row, lane);
    }

    // Each warp stages its rows of O through its own rows of the Q buffer (only this warp ever
    // read them, so no CTA barrier is needed), then writes 16-byte vectors, coalesced per row.
    static __device__ __forceinline__ void store_output(const float (&acc_o)[kMTiles][kOTiles][4],
                                                        const float (&row_lse)[kMTiles][2],
                                                        char* smem, Element* o,
                                                        long long o_row_stride, float* lse,
                                                        int rows_valid, int warp_row, int lane) {
        __syncwarp();
        algo::for_each_pair(acc_o, lane, [&](algo::FragmentCoord c, float lo, float hi) {
            *reinterpret_cast<uint32_t*>(smem + (warp_row + c.row) * kPitch + c.col * 2) = Ops::pack(lo, hi);
        });
        __syncwarp();
        constexpr int kWarpVecs = Config::kWarpRows * kOVecsPerRow;
#pragma unroll
        for (int idx = lane; idx < kWarpVecs; idx += 32) {
            const int row = idx / kOVecsPerRow;
            const int vec = idx % kOVecsPerRow;
            if (warp_row + row < rows_valid) {
                *reinterpret_cast<uint4*>(o + (warp_row + row) * o_row_stride + vec * 8) =
                    *reinterpret_cast<const uint4*>(smem + (warp_row + row) * kPitch + vec * 16);
            }
        }
        if (lse != nullptr && lane % 4 == 0) {
#pragma unroll
            for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = warp_row + 16 * m + lane / 4 + 8 * h;
                    if (row < rows_valid) lse[row] = row_lse[m][h];
                }
            }
        }
    }
};

}  // namespace fagen::fa2
