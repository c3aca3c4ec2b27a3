// FlashAttention-2 backward on mma.sync (sm_80 and later): recomputation from the forward's LSE,
// parallel over key blocks (FlashAttention-2, section 3.2; Algorithm 2 of FlashAttention-1 with
// the loops swapped per CTA).
//
// Three kernels of one cubin, run in order (fagen/contract.py, "Backward kernels"):
//   preprocess  per query row: D = rowsum(dO * O) in fp32, LSE in base 2 (+inf for a row that
//               saw no key, so that its probabilities come out 0), dQ's fp32 accumulator zeroed
//               (algo/backward_rows.cuh, shared with the FA3 backward).
//   main        one CTA per (key block j, K/V head, batch). K_j and V_j stay in shared memory;
//               dK_j and dV_j accumulate in registers while the CTA walks every query block i of
//               every query head its K/V head serves (GQA: the group's sum, with no copy of K/V
//               per query head), from the first block whose rows see key j (causal) on. Per
//               block:  S^T = K_j Q_i^T, P^T = exp2(S^T scale_log2 - LSE_i),
//                       dP^T = V_j dO_i^T, dS^T = P^T * (dP^T - D_i),
//               dS^T goes to shared memory (in the element type), and P^T too unless a
//               warp holds all of the step's queries (kProbsInRegisters), then
//                       dV_j += P^T dO_i,  dQ_i += dS K_j,  dK_j += dS^T Q_i
//               with dQ_i added to the fp32 accumulator in global memory by reductions, one
//               16-byte vector per lane and fragment tile (algo/backward_rows.cuh has the
//               layout): in any order, or in key-block order behind a counter per query block
//               (deterministic mode).
//   dq          dQ = softmax_scale * accumulator, in the element type (algo/backward_rows.cuh).
//
// Warps (kWarps of them) split S^T / dP^T and dK / dV by kKeyGroups groups of kWarpKeys keys
// (kKeyTiles m16 tiles) times kColSplits column parts (of the queries for S^T, of head_dim for
// dK / dV), and dQ by kQueryGroups groups of kWarpQueries queries (kDqRowTiles m16 tiles) times
// kDqSplits parts of head_dim (dK and dQ; dV: of head_dim_v). More rows per warp read each operand fragment for more MMAs:
// shared memory's bandwidth is what this kernel runs out of first (run 99).
//
// Shared memory: K_j, V_j (block_n rows each), then kStages stages of Q_i, dO_i (block_m rows
// each), LSE_i and D_i (block_m floats each), then dS^T and, unless kProbsInRegisters, P^T
// (block_n rows of block_m each). Rows of head_dim (Q, K) or head_dim_v (V, dO) elements have
// the forward's padded pitches;
// P^T / dS^T rows one 16-byte vector more than block_m elements, for the same reason (ldmatrix
// without bank conflicts).
#pragma once
#include "fagen/types.cuh"

#include "fagen/algo/backward_rows.cuh"
#include "fagen/algo/backward_tile.cuh"
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/smem_rows.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"
#include "fagen/ptx/cp_async.cuh"
#include "fagen/ptx/ex2.cuh"
#include "fagen/ptx/ldmatrix.cuh"
#include "fagen/ptx/red.cuh"

namespace fagen::fa2 {

template <class Config>
struct Backward {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;
    using Mask = typename Config::Mask;
    using Score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>;
    using DsoftcapOps = algo::ElementOps<__half>;  // the softcap's 1 - u^2, kept as fp16 pairs
    using Rows = algo::BackwardRows<Element, Config::kHeadDim, Config::kHeadDimV, Config::kBwdRowsPerCta,
                                    Config::kBwdRowThreads,
                                    Config::kDqAccumRowAlign, Config::kSinks, /*kFragmentTiles=*/true,
                                    Config::kVarlen>;
    using Row = typename Rows::Row;  // the tile's batch row (algo/batch_row.cuh)

    static constexpr int kThreads = Config::kThreads;
    static constexpr int kHeadDim = Config::kHeadDim;    // Q, K, dQ, dK columns
    static constexpr int kHeadDimV = Config::kHeadDimV;  // V, dO, dV columns
    static constexpr int kBlockM = Config::kBlockM;
    static constexpr int kBlockN = Config::kBlockN;
    static constexpr int kPitch = Config::kRowPitchBytes;    // Q, K rows
    static constexpr int kVPitch = Config::kVRowPitchBytes;  // V, dO rows
    static constexpr int kPPitch = Config::kPRowPitchBytes;  // P^T, dS^T rows
    static constexpr int kWarpKeys = Config::kWarpKeys;
    static constexpr int kKeyTiles = kWarpKeys / 16;            // m16 tiles of keys per warp
    static constexpr int kKeyGroups = kBlockN / kWarpKeys;
    static constexpr int kColSplits = Config::kWarps / kKeyGroups;
    static constexpr int kSTiles = kBlockM / kColSplits / 8;     // n8 tiles of S^T per warp
    static constexpr int kKCols = kHeadDim / kColSplits;         // dK columns per warp
    static constexpr int kKTiles = kKCols / 8;
    static constexpr int kVCols = kHeadDimV / kColSplits;        // dV columns per warp
    static constexpr int kVTiles = kVCols / 8;
    static constexpr int kWarpQueries = Config::kWarpQueries;
    static constexpr int kDqRowTiles = kWarpQueries / 16;        // m16 tiles of dQ rows per warp
    static constexpr int kQueryGroups = kBlockM / kWarpQueries;
    static constexpr int kDqSplits = Config::kWarps / kQueryGroups;
    static constexpr int kDqCols = kHeadDim / kDqSplits;
    // dQ is computed in chunks of at most 64 columns (see the main loop): the widest multiple of
    // 16 up to 64 that divides a warp's columns.
    static constexpr __host__ __device__ int dq_chunk_cols() {
        int cols = 64;
        while (kDqCols % cols) cols -= 16;
        return cols;
    }
    static constexpr int kDqChunkCols = dq_chunk_cols();
    static constexpr int kDqChunkTiles = kDqChunkCols / 8;
    static constexpr int kDqChunks = kDqCols / kDqChunkCols;
    static constexpr int kDqTiles = kDqRowTiles * kDqChunkTiles;  // a chunk's C fragments per warp
    static constexpr int kMSteps = kBlockM / 16;   // over the queries of a block
    static constexpr int kNSteps = kBlockN / 16;   // over the keys of a block
    // dQ's last chunk is added during dK's product, kDqPerStep fragments after each of its
    // k-steps until none is left (the main loop says why): one more than an even share where
    // there are more fragments than k-steps, so that the last steps keep fewer of them live
    // (with an even share the causal tile at head_dim 256 spilled).
    static constexpr int kDqPerStep = (kDqTiles + kMSteps - 1) / kMSteps + (kDqTiles > kMSteps ? 1 : 0);

    static_assert(kWarpKeys % 16 == 0 && kWarpQueries % 16 == 0);
    static_assert(kKeyGroups * kColSplits == Config::kWarps, "warps = key groups x column parts");
    static_assert(kQueryGroups * kDqSplits == Config::kWarps, "warps = query groups x dQ parts");
    static_assert(kSTiles % 2 == 0 && kKTiles % 2 == 0 && kVTiles % 2 == 0 && kDqChunkTiles % 2 == 0 &&
                      kDqCols % kDqChunkCols == 0,
                  "ldmatrix.x4 loads operand pairs of n8 tiles");
    static_assert(kPitch % 16 == 0 && (kPitch / 16) % 2 == 1 && kVPitch % 16 == 0 &&
                      (kVPitch / 16) % 2 == 1 && kPPitch % 16 == 0 && (kPPitch / 16) % 2 == 1,
                  "an odd number of 16-byte vectors per row keeps ldmatrix conflict-free");
    static_assert(Config::kStages == 1 || Config::kStages == 2);

    // Shared-memory layout (byte offsets, fagen/model/fa2_bwd.py re-derives them).
    static constexpr int kTileBytes = kBlockN * kPitch;           // K_j
    static constexpr int kVTileBytes = kBlockN * kVPitch;         // V_j
    static constexpr int kQTileBytes = kBlockM * kPitch;          // Q_i
    static constexpr int kDoTileBytes = kBlockM * kVPitch;        // dO_i
    static constexpr int kStageBytes = kQTileBytes + kDoTileBytes + 2 * kBlockM * 4;
    static constexpr int kStagesOffset = kTileBytes + kVTileBytes;
    static constexpr int kDsOffset = kStagesOffset + Config::kStages * kStageBytes;
    static constexpr int kPTileBytes = kBlockN * kPPitch;
    static constexpr bool kProbsInRegisters = Config::kProbsInRegisters;
    static_assert(kProbsInRegisters == (kColSplits == 1),
                  "P^T stays in registers exactly when a warp holds all of a step's queries");
    static_assert(kDsOffset + (kProbsInRegisters ? 1 : 2) * kPTileBytes == Config::kSmemBytes);

    struct Smem {
        uint32_t base;
        __device__ uint32_t k() const { return base; }
        __device__ uint32_t v() const { return base + kTileBytes; }
        __device__ uint32_t q(int stage) const { return base + kStagesOffset + stage * kStageBytes; }
        __device__ uint32_t dout(int stage) const { return q(stage) + kQTileBytes; }
        __device__ uint32_t lse(int stage) const { return dout(stage) + kDoTileBytes; }
        __device__ uint32_t d(int stage) const { return lse(stage) + kBlockM * 4; }
        __device__ uint32_t ds() const { return base + kDsOffset; }
        __device__ uint32_t p() const { return ds() + kPTileBytes; }  // unless kProbsInRegisters
    };

    // ---------------------------------------------------------------- warp products
    // acc[m][2 np] and acc[m][2 np + 1] += A_m (16 x 16) * the two n8 halves of one ldmatrix.x4
    // B fragment, for each of the warp's kM m16 tiles: the inner step of every product below.
    template <int kM, int kN>
    static __device__ __forceinline__ void mma_tile_pair(float (&acc)[kM][kN][4], const uint32_t (&a)[kM][4],
                                                         const uint32_t (&b)[4], int np) {
        const uint32_t lo[2] = {b[0], b[1]}, hi[2] = {b[2], b[3]};
#pragma unroll
        for (int m = 0; m < kM; ++m) {
            Ops::mma(acc[m][2 * np], a[m], lo);
            Ops::mma(acc[m][2 * np + 1], a[m], hi);
        }
    }

    // acc (16*kM x 8*kN) = A (16*kM x kCols, row-major at `a`) * B^T, B (8*kN x kCols,
    // row-major at `b`), both of row pitch kRowPitch: the per-lane ldmatrix addresses are folded
    // into `a` and `b`.
    template <int kCols, int kRowPitch, int kM, int kN>
    static __device__ __forceinline__ void warp_product_nt(float (&acc)[kM][kN][4], uint32_t a,
                                                           uint32_t b) {
        algo::clear_fragment(acc);
#pragma unroll
        for (int kk = 0; kk < kCols / 16; ++kk) {
            uint32_t frag_a[kM][4];
#pragma unroll
            for (int m = 0; m < kM; ++m) ptx::ldmatrix_x4(frag_a[m], a + m * 16 * kRowPitch + kk * 32);
#pragma unroll
            for (int np = 0; np < kN / 2; ++np) {
                uint32_t frag_b[4];
                ptx::ldmatrix_x4(frag_b, b + np * 16 * kRowPitch + kk * 32);
                mma_tile_pair(acc, frag_a, frag_b, np);
            }
        }
    }

    // acc (16*kM x 8*kN) += A (16*kM x block_m, row-major at `a`, the P^T / dS^T pitch) *
    // B (block_m x 8*kN, row-major at `b`, row pitch kBPitch (Q's or dO's), read transposed);
    // after_step(kk) runs after the MMAs of each k16 step.
    template <int kBPitch, int kM, int kN, class AfterStep>
    static __device__ __forceinline__ void warp_product_nn(float (&acc)[kM][kN][4], uint32_t a, uint32_t b,
                                                           AfterStep&& after_step) {
#pragma unroll
        for (int kk = 0; kk < kMSteps; ++kk) {
            uint32_t frag_a[kM][4];
#pragma unroll
            for (int m = 0; m < kM; ++m) ptx::ldmatrix_x4(frag_a[m], a + m * 16 * kPPitch + kk * 32);
#pragma unroll
            for (int dp = 0; dp < kN / 2; ++dp) {
                uint32_t frag_b[4];
                ptx::ldmatrix_x4_trans(frag_b, b + kk * 16 * kBPitch + dp * 32);
                mma_tile_pair(acc, frag_a, frag_b, dp);
            }
            after_step(kk);
        }
    }

    template <int kBPitch, int kM, int kN>
    static __device__ __forceinline__ void warp_product_nn(float (&acc)[kM][kN][4], uint32_t a,
                                                           uint32_t b) {
        warp_product_nn<kBPitch>(acc, a, b, [](int) {});
    }

    // acc = this warp's dQ rows x kDqChunkCols columns from dq_col = dS K: A from dS^T (at
    // `ds`, the per-lane address of a transposed A read), B from K (`k`, the per-lane address
    // of a transposed B read).
    static __device__ __forceinline__ void dq_product(float (&acc)[kDqRowTiles][kDqChunkTiles][4], uint32_t ds,
                                                      uint32_t k, int dq_col) {
        algo::clear_fragment(acc);
#pragma unroll
        for (int kk = 0; kk < kNSteps; ++kk) {
            uint32_t a_ds[kDqRowTiles][4];
#pragma unroll
            for (int m = 0; m < kDqRowTiles; ++m) ptx::ldmatrix_x4_trans(a_ds[m], ds + kk * 16 * kPPitch + m * 32);
#pragma unroll
            for (int dp = 0; dp < kDqChunkTiles / 2; ++dp) {
                uint32_t b_k[4];
                ptx::ldmatrix_x4_trans(b_k, k + kk * 16 * kPitch + (dq_col + dp * 16) * 2);
                mma_tile_pair(acc, a_ds, b_k, dp);
            }
        }
    }

    // warp_product_nn with A from an accumulator over the step's queries (P^T or dS^T in the
    // layout of algo/fragment.cuh, rounded to the element type per k16 step), B (block_m x
    // 8*kN, row-major at `b`, row pitch kBPitch, read transposed).
    template <int kBPitch, int kM, int kN>
    static __device__ __forceinline__ void warp_product_nn(float (&acc)[kM][kN][4],
                                                           const float (&a)[kM][kSTiles][4], uint32_t b) {
#pragma unroll
        for (int kk = 0; kk < kMSteps; ++kk) {
            uint32_t frag_a[kM][4];
#pragma unroll
            for (int m = 0; m < kM; ++m) algo::pack_a_fragment<Element>(frag_a[m], a[m], kk);
#pragma unroll
            for (int dp = 0; dp < kN / 2; ++dp) {
                uint32_t frag_b[4];
                ptx::ldmatrix_x4_trans(frag_b, b + kk * 16 * kBPitch + dp * 32);
                mma_tile_pair(acc, frag_a, frag_b, dp);
            }
        }
    }

    // A warp's kWarpKeys x (8*kSTiles) part of P^T or dS^T into its tile in shared memory, as
    // the element type.
    static __device__ __forceinline__ void store_probs(uint32_t tile, const float (&acc)[kKeyTiles][kSTiles][4],
                                                       int warp_key, int warp_query, int lane) {
        algo::for_each_pair(acc, lane, [&](algo::FragmentCoord f, float lo, float hi) {
            const uint32_t at = (warp_key + f.row) * kPPitch + (warp_query + f.col) * 2;
            *static_cast<uint32_t*>(__cvta_shared_to_generic(tile + at)) = Ops::pack(lo, hi);
        });
    }

    // ---------------------------------------------------------------- main
    // LSE and D of a query block into shared memory, one float per thread of the first
    // 2 * kBlockM, with cp.async like the tiles (a plain load's wait stalled its warp inside
    // every step). Rows past seqlen_q arrive as zeros: finite, since 0 * (dP - D) must stay 0
    // (4-byte copies: a 16-byte one could read past the end of the array).
    static_assert(2 * kBlockM <= kThreads, "one thread per float of LSE_i and D_i");
    static __device__ __forceinline__ void load_row_floats(uint32_t lse_dst, uint32_t d_dst,
                                                           const FagenBwdParams& p, long long row0,
                                                           int rows_valid, int tid) {
        if (tid < 2 * kBlockM) {
            const int row = tid % kBlockM;
            const float* src = (tid < kBlockM ? p.lse_log2 : p.softmax_d) + row0 + row;
            ptx::cp_async_ca_4((tid < kBlockM ? lse_dst : d_dst) + row * 4, src, row < rows_valid);
        }
    }

    static __device__ void run(const FagenBwdParams& p, char* smem_raw) {
        const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
        const typename Order::Tile tile = tile_of_cta(p);
        const int n_block = tile.n_block, kv_head = tile.head_of_batch % p.heads_kv;
        const int batch = tile.head_of_batch / p.heads_kv;
        const int group = p.heads_q / p.heads_kv;
        // The walk counts its query heads over the batch (batch * heads_q + head: the index of
        // the LSE, D, dQ-accumulator and semaphore rows), and the stores of dK and dV after it
        // find their head from the CTA index again, so that the loop keeps neither batch nor K/V
        // head live (with them the causal tile at head_dim 128 spilled).
        const int first_head = tile.head_of_batch * group;
        const int key_begin = n_block * kBlockN;
        const Row seq = Row::of(p, batch);
        const int seqlen_q = seq.seqlen_q(p), seqlen_k = seq.seqlen_k(p);
        const Mask mask = Mask::of(p, batch, seqlen_q, seqlen_k);
        // The query blocks [i_begin, i_end) with a row that sees one of this tile's keys (none
        // for a varlen tile past its batch row's keys).
        const algo::KeyBlocks queries = mask.query_blocks(key_begin, kBlockN, kBlockM);
        const int i_begin = queries.begin, i_end = queries.end;
        const int i_count = Config::kVarlen && key_begin >= seqlen_k ? 0 : max(0, queries.count());
        const int steps = group * i_count;  // (query head, query block) pairs this CTA walks

        const Smem s{static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw))};
        const Element* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                           kv_head * p.k_head_stride + (seq.k_begin() + key_begin) * p.k_row_stride;
        const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                           kv_head * p.v_head_stride + (seq.k_begin() + key_begin) * p.v_row_stride;
        const int keys_valid = seqlen_k - key_begin;

        const int key_group = warp % kKeyGroups, col_split = warp / kKeyGroups;
        const int query_group = warp % kQueryGroups, dq_split = warp / kQueryGroups;

        // The next step to load: its rows of Q and dO and its first row in LSE and D, moved
        // one query block on per step, and from the end of a head's walk to the start of the
        // next head's (of the same batch) when the walk moves on.
        algo::StepCursor loading{first_head, i_begin};
        const int first_row = i_begin * kBlockM;
        const Element* q_rows = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                                kv_head * group * p.q_head_stride + (seq.q_begin() + first_row) * p.q_row_stride;
        const Element* dout_rows = static_cast<const Element*>(p.dout) + batch * p.do_batch_stride +
                                   kv_head * group * p.do_head_stride +
                                   (seq.q_begin() + first_row) * p.do_row_stride;
        long long lse_row0 = (Config::kVarlen ? seq.row_array(p, batch, kv_head * group)
                                              : static_cast<long long>(first_head) * p.seqlen_q) + first_row;
        auto load_step = [&](int stage) {
            const int rows_valid = seqlen_q - loading.block * kBlockM;
            algo::load_rows<Element, kBlockM, kHeadDim, kPitch, kThreads>(s.q(stage), q_rows, p.q_row_stride,
                                                                          rows_valid, tid);
            algo::load_rows<Element, kBlockM, kHeadDimV, kVPitch, kThreads>(s.dout(stage), dout_rows,
                                                                            p.do_row_stride, rows_valid, tid);
            load_row_floats(s.lse(stage), s.d(stage), p, lse_row0, rows_valid, tid);
            const int head = loading.head;
            loading.advance(i_begin, i_end);
            q_rows += kBlockM * p.q_row_stride;
            dout_rows += kBlockM * p.do_row_stride;
            lse_row0 += kBlockM;
            if (loading.head != head) {
                const int walked = i_count * kBlockM;
                q_rows += p.q_head_stride - walked * p.q_row_stride;
                dout_rows += p.do_head_stride - walked * p.do_row_stride;
                lse_row0 += seq.rows_per_head(p) - walked;
            }
        };

        float acc_dk[kKeyTiles][kKTiles][4];
        float acc_dv[kKeyTiles][kVTiles][4];
        algo::clear_fragment(acc_dk);
        algo::clear_fragment(acc_dv);

        algo::load_rows<Element, kBlockN, kHeadDim, kPitch, kThreads>(s.k(), k, p.k_row_stride, keys_valid, tid);
        algo::load_rows<Element, kBlockN, kHeadDimV, kVPitch, kThreads>(s.v(), v, p.v_row_stride, keys_valid, tid);
        if (steps > 0) load_step(0);
        ptx::cp_async_commit_group();

        // Per-lane byte offsets of the ldmatrix row addresses (forward.cuh has the same three):
        // an A operand read from row-major [m][k] tiles, a B operand from [n][k] (non-transposed)
        // and a B operand from [k][n] (transposed); v_ for the rows of V and dO.
        const uint32_t a_lane = (lane % 16) * kPitch + (lane / 16) * 16;
        const uint32_t b_lane = (lane % 8 + 8 * (lane / 16)) * kPitch + ((lane / 8) % 2) * 16;
        const uint32_t bt_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + (lane / 16) * 16;
        const uint32_t v_a_lane = (lane % 16) * kVPitch + (lane / 16) * 16;
        const uint32_t v_b_lane = (lane % 8 + 8 * (lane / 16)) * kVPitch + ((lane / 8) % 2) * 16;
        const uint32_t v_bt_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kVPitch + (lane / 16) * 16;
        // The same over P^T / dS^T rows, and an A operand read transposed from [k][m] (dS from dS^T).
        const uint32_t pa_lane = (lane % 16) * kPPitch + (lane / 16) * 16;
        const uint32_t pat_lane = (lane % 8 + 8 * (lane / 16)) * kPPitch + ((lane / 8) % 2) * 16;

        const int warp_key = key_group * kWarpKeys;     // first key of this warp (within the block)
        const int warp_query = col_split * (kBlockM / kColSplits);  // first S^T column

        algo::StepCursor current{first_head, i_begin};
        for (int t = 0; t < steps; ++t, current.advance(i_begin, i_end)) {
            const int stage = Config::kStages == 2 ? t % 2 : 0;
            ptx::cp_async_wait_group<0>();
            __syncthreads();  // step t landed; every warp is done with step t-1
            if constexpr (Config::kStages == 2) {
                if (t + 1 < steps) load_step((t + 1) % 2);
                ptx::cp_async_commit_group();
            }
            const int head = current.head, m_block = current.block;
            const int row_begin = m_block * kBlockM;

            // S^T, then P^T = exp2(S^T scale_log2 - LSE) with the mask (keys past seqlen_k,
            // queries past seqlen_q, causal) applied only on the steps that need it, as a branch
            // of its own (algo::zero_masked_probs says why), then dP^T and dS^T = P^T (dP^T - D):
            // for this warp's keys and its part of the queries. Masking P^T before dP^T exists
            // zeroes dS^T with it and keeps the mask's predicates clear of the dP^T accumulator
            // (with both live, the causal 64-query tile at head_dim 128 spilled).
            const float* lse = reinterpret_cast<const float*>(__cvta_shared_to_generic(s.lse(stage)));
            const float* dsum = reinterpret_cast<const float*>(__cvta_shared_to_generic(s.d(stage)));
            const int first_key = key_begin + warp_key, first_query = row_begin + warp_query;
            const bool needs_mask = first_query + kBlockM / kColSplits > seqlen_q ||
                                    mask.block_needs_mask(first_key / kWarpKeys, first_query, kBlockM / kColSplits, kWarpKeys);
            float acc_s[kKeyTiles][kSTiles][4];
            float acc_dp[kKeyTiles][kSTiles][4];
            // The softcap's 1 - u^2 per score (algo/score.cuh), for dS, as fp16 pairs.
            uint32_t dsoftcap[Config::kSoftcap ? kKeyTiles : 1][Config::kSoftcap ? kSTiles : 1][2];
            const auto score = Score::of(p, batch, head - batch * p.heads_q, seqlen_q, seqlen_k);
            warp_product_nt<kHeadDim, kPitch>(acc_s, s.k() + a_lane + warp_key * kPitch,
                                              s.q(stage) + b_lane + warp_query * kPitch);
#pragma unroll
            for (int m = 0; m < kKeyTiles; ++m)
#pragma unroll
                for (int n = 0; n < kSTiles; ++n) {
                    float grads[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const algo::FragmentCoord f = algo::fragment_coord(lane, m, n, i);
                        float u = acc_s[m][n][i];
                        if constexpr (!Score::kIdentity) u = score.modify(u, first_query + f.col, first_key + f.row, grads[i]);
                        acc_s[m][n][i] = ptx::ex2_approx_ftz(algo::backward_exponent(u, p.scale_log2, lse[warp_query + f.col]));
                    }
                    if constexpr (Config::kSoftcap) {
                        dsoftcap[m][n][0] = DsoftcapOps::pack(grads[0], grads[1]);
                        dsoftcap[m][n][1] = DsoftcapOps::pack(grads[2], grads[3]);
                    }
                }
            if (needs_mask) {
#pragma unroll
                for (int m = 0; m < kKeyTiles; ++m)
#pragma unroll
                    for (int n = 0; n < kSTiles; ++n)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const algo::FragmentCoord f = algo::fragment_coord(lane, m, n, i);
                            const int key_abs = first_key + f.row, query_abs = first_query + f.col;
                            if (query_abs >= seqlen_q || mask.masked(query_abs, key_abs)) acc_s[m][n][i] = 0.f;
                        }
            }
            warp_product_nt<kHeadDimV, kVPitch>(acc_dp, s.v() + v_a_lane + warp_key * kVPitch,
                                                s.dout(stage) + v_b_lane + warp_query * kVPitch);
#pragma unroll
            for (int m = 0; m < kKeyTiles; ++m)
#pragma unroll
                for (int n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int query = warp_query + algo::fragment_coord(lane, m, n, i).col;
                        acc_dp[m][n][i] = acc_s[m][n][i] * (acc_dp[m][n][i] - dsum[query]);
                        if constexpr (Config::kSoftcap) {
                            const float2 grads = DsoftcapOps::unpack(dsoftcap[m][n][i / 2]);
                            acc_dp[m][n][i] *= i & 1 ? grads.y : grads.x;
                        }
                    }
            store_probs(s.ds(), acc_dp, warp_key, warp_query, lane);

            // dQ (kWarpQueries queries x kDqCols) += dS K, added to the accumulator in global
            // memory in chunks of kDqChunkCols columns (a whole 16 x 128 chunk beside dK and dV
            // spills at head_dim 256).
            const DqRows dq_rows{p.dq_accum + Rows::accum_head(p, seq, batch, head) + row_begin * kHeadDim,
                                 seqlen_q - row_begin, query_group * kWarpQueries, lane};
            const uint32_t ds_lane = s.ds() + pat_lane + query_group * kWarpQueries * 2;
            float acc_dq[kDqRowTiles][kDqChunkTiles][4];
            auto dq_chunk = [&](int chunk) {  // its product into acc_dq; returns its first column
                const int col = dq_split * kDqCols + chunk * kDqChunkCols;
                dq_product(acc_dq, ds_lane, s.k() + bt_lane, col);
                return col;
            };

            // dV += P^T dO and dK += dS^T Q: this warp's keys, its part of head_dim. With
            // every query of the step in this warp, P^T and dS^T are A operands straight from
            // the accumulators (the C fragments of two n8 tiles are the A fragment of a k16
            // step), and the products run while the other warps finish their dS^T. Otherwise
            // dQ's product goes between dV's and dK's, and its last chunk's reductions are
            // spread over dK's k-steps, a few after each step's MMAs: issued at once, they
            // filled the global-memory queue (run 111), stalling the warp and every instruction
            // that reused their registers (spread: 1.02-1.09x, run 114, and up to 1.03x more with
            // kDqPerStep's extra one, run 116; dQ last instead of between the products: 1.00-1.03x
            // less at head dims 64 and 128, run 107).
            const uint32_t k_col_bytes = col_split * kKCols * 2, v_col_bytes = col_split * kVCols * 2;
            if constexpr (kProbsInRegisters) {
                warp_product_nn<kVPitch>(acc_dv, acc_s, s.dout(stage) + v_bt_lane + v_col_bytes);
                warp_product_nn<kPitch>(acc_dk, acc_dp, s.q(stage) + bt_lane + k_col_bytes);
                __syncthreads();  // dS^T of the whole block is in shared memory
                DqTurn turn(p, mask, head, m_block, n_block);
#pragma unroll
                for (int chunk = 0; chunk < kDqChunks; ++chunk) add_dq(dq_rows, acc_dq, dq_chunk(chunk), 0, kDqTiles);
                turn.pass();
            } else {
                store_probs(s.p(), acc_s, warp_key, warp_query, lane);
                __syncthreads();  // P^T and dS^T of the whole block are in shared memory
                warp_product_nn<kVPitch>(acc_dv, s.p() + pa_lane + warp_key * kPPitch,
                                         s.dout(stage) + v_bt_lane + v_col_bytes);
                DqTurn turn(p, mask, head, m_block, n_block);
#pragma unroll
                for (int chunk = 0; chunk + 1 < kDqChunks; ++chunk) add_dq(dq_rows, acc_dq, dq_chunk(chunk), 0, kDqTiles);
                const int last_col = dq_chunk(kDqChunks - 1);
                warp_product_nn<kPitch>(acc_dk, s.ds() + pa_lane + warp_key * kPPitch,
                                        s.q(stage) + bt_lane + k_col_bytes, [&](int kk) {
                                            add_dq(dq_rows, acc_dq, last_col, kk * kDqPerStep, kDqPerStep);
                                        });
                turn.pass();
            }

            if constexpr (Config::kStages == 1) {
                __syncthreads();  // every warp is done with Q_i, dO_i
                if (t + 1 < steps) load_step(0);
                ptx::cp_async_commit_group();
            }
        }
        ptx::cp_async_wait_group<0>();

        const typename Order::Tile again = tile_of_cta(p);
        const int end_batch = again.head_of_batch / p.heads_kv, end_kv_head = again.head_of_batch % p.heads_kv;
        const Row end_seq = Row::of(p, end_batch);
        store_kv(p, end_seq, acc_dk, p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, p.softmax_scale,
                 end_batch, end_kv_head, key_begin + warp_key, col_split * kKCols, lane);
        store_kv(p, end_seq, acc_dv, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, 1.f,
                 end_batch, end_kv_head, key_begin + warp_key, col_split * kVCols, lane);
    }

    using Order = algo::TileOrder<Mask, kBlockM, kBlockN>;

    // The tile of this CTA: grid (key blocks, heads_kv, batch) in the launch order of
    // algo::TileOrder.
    static __device__ typename Order::Tile tile_of_cta(const FagenBwdParams& p) {
        return Order::at(p, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z),
                         static_cast<int>(gridDim.x), static_cast<int>(gridDim.y * gridDim.z));
    }

    // Deterministic mode's turn of a CTA on dQ_i (algo/backward_tile.cuh): the CTAs add with
    // the same reductions, one CTA at a time in key-block order, so every element of the
    // accumulator sums its terms in one order. Without a semaphore array they add in any order.
    struct DqTurn {
        int* semaphore = nullptr;

        __device__ DqTurn(const FagenBwdParams& p, const Mask& mask, int head, int m_block, int n_block) {
            if (p.dq_semaphore == nullptr) return;
            semaphore = Order::semaphore(p, head, m_block);
            const int rank = Order::rank(mask, m_block, n_block);
            if (threadIdx.x == 0) {
                while (atomicAdd(semaphore, 0) != rank) {
                }
                __threadfence();
            }
            __syncthreads();
        }

        __device__ void pass() const {
            if (semaphore == nullptr) return;
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) atomicAdd(semaphore, 1);
        }
    };

    // Where a warp adds its dQ rows of a step: the accumulator from the query block's first row
    // on (a multiple of 16 rows), the block's rows before seqlen_q, the warp's first row.
    struct DqRows {
        float* accum;
        int rows_valid, warp_row, lane;
    };

    // `count` of a warp's C fragments of dQ_i (kDqRowTiles x kDqChunkTiles, row tiles outer)
    // from `first` on, at columns col0.., into the accumulator. Its fragment tiles
    // (algo/backward_rows.cuh) take each as one 16-byte reduction per lane: one address per
    // thread, every tile at a constant offset from it. Row groups wholly past seqlen_q are left
    // out (the rest of a group falls in the head's padding).
    static __device__ __forceinline__ void add_dq(const DqRows& rows, const float (&acc)[kDqRowTiles][kDqChunkTiles][4],
                                                  int col0, int first, int count) {
        float* const origin = rows.accum + rows.warp_row * kHeadDim + (col0 / 8) * 128 + 4 * rows.lane;
#pragma unroll
        for (int t = first; t < first + count && t < kDqTiles; ++t) {
            const int m = t / kDqChunkTiles, n = t % kDqChunkTiles;
            if (rows.warp_row + 16 * m >= rows.rows_valid) continue;
            float* at = origin + 16 * m * kHeadDim + n * 128;
            if constexpr (Config::kVectorReductions) {
                ptx::red_global_add_v4_f32(at, acc[m][n][0], acc[m][n][1], acc[m][n][2], acc[m][n][3]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) atomicAdd(at + i, acc[m][n][i]);
            }
        }
    }

    // A warp's dK or dV rows from the accumulator layout (kTiles n8 tiles of columns from
    // col0): scale * acc as the element type, rows first_key... past seqlen_k left out.
    template <int kTiles>
    static __device__ __forceinline__ void store_kv(const FagenBwdParams& p, const Row& seq,
                                                    const float (&acc)[kKeyTiles][kTiles][4], void* out,
                                                    long long batch_stride, long long row_stride,
                                                    long long head_stride, float scale, int batch,
                                                    int kv_head, int first_key, int col0, int lane) {
        Element* const origin = static_cast<Element*>(out) + batch * batch_stride + kv_head * head_stride +
                                seq.k_begin() * row_stride;
        algo::for_each_pair(acc, lane, [&](algo::FragmentCoord f, float lo, float hi) {
            const int key = first_key + f.row;
            if (key < seq.seqlen_k(p)) {
                *reinterpret_cast<uint32_t*>(origin + key * row_stride + col0 + f.col) = Ops::pack(lo * scale, hi * scale);
            }
        });
    }
};

}  // namespace fagen::fa2
