// FlashAttention-3 backward on Hopper (sm_90a): the FA2 backward's recomputation (fa2/backward.cuh:
// a key block's dK and dV stay in registers while it walks the query blocks) with TMA loads into
// an mbarrier ring, wgmma for all five products, warp specialization with register reallocation
// (FlashAttention-3 paper, section 3 and its backward). Dense or varlen (Config::kVarlen:
// algo/batch_row.cuh; a varlen map spans the packed rows, batch 1).
//
// Three kernels of one cubin (fagen/contract.py, "Backward kernels"): the row kernels of
// algo/backward_rows.cuh before and after this file's main kernel.
//
// One CTA per tile (key block, K/V head, batch), which walks the query blocks of 64 rows of every
// query head its K/V head serves. Roles (warpgroup = 128 threads):
//   producer  (warpgroup 0, three roles): one thread loads K_j, V_j once and Q_i, dO_i per
//             step by TMA into a ring of kStages; warp 1 loads LSE_i and D_i (LSE +inf and D 0 for
//             the rows past seqlen_q, which TMA fills with zeros: their probabilities and dS come
//             out 0 with no mask); one thread of warp 2 is the dQ writer, which adds the consumers'
//             parts of dQ_i to the fp32 accumulator in global memory by TMA reductions (in
//             deterministic mode in key-block order, behind a counter per query block).
//   consumers (warpgroups 1 and 2) share the tile in one of two ways (fagen/model/fa3_bwd.py
//             derives which from their registers):
//     key split (head_dim 64, 128; 128 keys): consumer c owns keys c*64 ... c*64+63 and keeps
//             dK, dV for them in registers. Per step (query block i):
//               S^T  = K_c Q_i^T,  dP^T = V_c dO_i^T            (wgmma, both operands in smem)
//               P^T  = exp2(S^T scale_log2 - LSE_i),  dS^T = P^T (dP^T - D_i)   (registers)
//               dV_c += P^T dO_i,  dK_c += dS^T Q_i             (wgmma, A from registers)
//               dS^T to shared memory, then dQ_i += dS K         (wgmma, both MN-major in smem)
//             and its part of dQ_i into a staging tile for the dQ writer. Each consumer takes
//             head_dim / 2 columns of dQ over all 128 keys (both consumers' dS^T in smem, a named
//             barrier between them, two dS^T buffers so that the next step's writes never meet
//             the other consumer's reads).
//     column split (head_dim 256; 64 keys): both consumers see all the keys; consumer c owns
//             columns c*128 ... of dK, dV and dQ, and computes S^T, dP^T for queries c*32 ... of
//             the step. P^T and dS^T go to shared memory (two buffers each), dV, dK and dQ read
//             them from there, and a consumer stages its part of dQ_i in its own columns of the
//             step's Q and dO tiles, which the dQ writer then frees.
//   At the end each consumer writes its dK, dV through shared memory (the K and V tiles), so
//   that the global stores are whole 16-byte pieces.
//
// Shared memory (every tile 1024-byte aligned for the 128-byte swizzle; offsets from
// fagen/model/fa3_bwd.py): K, V (block_n rows), kStages Q and dO tiles (block_m rows), the dS^T
// buffers (block_n rows of block_m = 64 elements: one swizzle atom wide), the column split's P^T
// buffers (the same), the key split's dQ staging tiles (one per consumer, 64 rows x head_dim / 2
// fp32 columns, in TMA boxes of 32 columns), kStages pairs of LSE and D (block_m floats each),
// then the mbarriers.
#pragma once

#include "fagen/algo/backward_rows.cuh"
#include "fagen/algo/backward_tile.cuh"
#include "fagen/algo/fragment.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/tma_tile.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"
#include "fagen/ptx/bar.cuh"
#include "fagen/ptx/cp_async_bulk_commit_group.cuh"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/cp_async_bulk_wait_group.cuh"
#include "fagen/ptx/cp_reduce_async_bulk_tensor.cuh"
#include "fagen/ptx/ex2.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/setmaxnreg.cuh"
#include "fagen/ptx/wgmma.cuh"
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/ptx/wgmma_sync.cuh"
#include "fagen/types.cuh"

namespace fagen::fa3 {

template <class Config>
struct Backward {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;
    using Mask = algo::AttentionMask<Config::kMask>;
    using Score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>;
    using Rows = algo::BackwardRows<Element, Config::kHeadDim, Config::kHeadDimV, Config::kBwdRowsPerCta,
                                    Config::kBwdRowThreads, Config::kDqAccumRowAlign, Config::kSinks,
                                    /*kFragmentTiles=*/false, Config::kVarlen>;
    using Row = typename Rows::Row;  // a tile's batch row (algo/batch_row.cuh)
    // The CTA's tile (key block, K/V head, batch) and its steps (query heads of the group, then
    // query blocks), in the launch order of algo::TileOrder.
    using Walk = algo::BackwardWalk<Mask, Row, Config::kBlockM, Config::kBlockN>;
    using Order = typename Walk::Order;

    static constexpr int kHeadDim = Config::kHeadDim;
    static constexpr int kBlockM = Config::kBlockM;  // queries per step
    static constexpr int kBlockN = Config::kBlockN;  // keys per CTA
    static constexpr int kStages = Config::kStages;
    static constexpr int kConsumers = 2;
    static constexpr int kConsumerThreads = kConsumers * 128;
    // How the consumers share the tile (fagen/model/fa3_bwd.py): the key split gives each its own
    // 64 keys with every column; the column split gives both the tile's 64 keys, each with
    // head_dim / 2 columns of dK, dV and the scores of half of the step's queries.
    static constexpr bool kColumnSplit = Config::kColumnSplit;
    static constexpr int kConsumerKeys = kColumnSplit ? kBlockN : kBlockN / kConsumers;  // wgmma m64
    static constexpr int kScoreQueries = kColumnSplit ? kBlockM / kConsumers : kBlockM;  // of S^T, dP^T
    static constexpr int kGradColumns = kColumnSplit ? kHeadDim / kConsumers : kHeadDim;  // of dK, dV
    static constexpr int kChunks = kHeadDim / 64;               // 128-byte column chunks
    static constexpr int kQKSteps = kHeadDim / 16;              // k16 steps of S^T and dP^T
    static constexpr int kQuerySteps = kBlockM / 16;            // k16 steps of dV and dK
    static constexpr int kSTiles = kScoreQueries / 8;           // n8 tiles of S^T per warp
    // The softcap's 1 - u^2 per score (algo/score.cuh), kept for dS as fp16 pairs (its fp32
    // copy spilled 32 bytes at head_dim 128); one unused tile without.
    static constexpr int kSoftcapTiles = Config::kSoftcap ? kSTiles : 1;
    using DsoftcapOps = algo::ElementOps<__half>;
    static constexpr int kKVTiles = kGradColumns / 8;           // n8 tiles of dK, dV per warp
    static constexpr int kDqColumns = kHeadDim / kConsumers;  // a consumer's part of dQ
    static constexpr int kDqTiles = kDqColumns / 8;
    static constexpr int kDqKeySteps = kBlockN / 16;
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * 2;
    static constexpr uint32_t kDsBytes = kBlockN * kBlockM * 2;
    static constexpr int kDqBoxColumns = Config::kAccumBoxColumns;  // fp32: 128 bytes, one swizzle row
    static constexpr uint32_t kDqBoxBytes = kBlockM * kDqBoxColumns * 4;
    static constexpr uint32_t kDqStageBytes = (kDqColumns / kDqBoxColumns) * kDqBoxBytes;
    static constexpr uint32_t kAtom = algo::kSwizzleAtomBytes;
    static constexpr int kRowLoaderLanes = 32;  // the producer warpgroup's warp 1

    static_assert(Config::kThreads == (kConsumers + 1) * 128, "a producer warpgroup + 2 consumers");
    static_assert(kConsumerKeys == 64, "a consumer's dK, dV rows are one wgmma m64 tile");
    static_assert(kBlockM == 64, "dS^T rows of 64 elements: one 128-byte swizzle atom wide");
    static_assert(kHeadDim % 64 == 0, "TMA boxes and swizzle atoms are 64 columns wide");
    static_assert(kDqColumns % kDqBoxColumns == 0 && (64 % kDqColumns == 0 || kDqColumns % 64 == 0),
                  "a consumer's dQ columns are whole accumulator boxes inside or across K's chunks");
    static_assert(kDqBoxColumns * 4 == 128, "a box row of the accumulator map is one swizzle row");
    static_assert(Config::kDsBuffers == 2 && Config::kPtBuffers == (kColumnSplit ? 2 : 0));
    static_assert(!kColumnSplit || (kConsumerKeys == kBlockN && kDqColumns == kGradColumns &&
                                    kDqStageBytes == 2 * (kQBytes / kConsumers)),
                  "column split: a consumer's dQ part is staged in its columns of the Q and dO tiles");
    static_assert(Config::kSmemKOffset == 0 && Config::kSmemVOffset == kKVBytes &&
                  Config::kSmemQOffset == 2 * kKVBytes &&
                  Config::kSmemDoOffset == Config::kSmemQOffset + kStages * kQBytes &&
                  Config::kSmemDsOffset == Config::kSmemDoOffset + kStages * kQBytes &&
                  Config::kSmemPtOffset == Config::kSmemDsOffset + Config::kDsBuffers * kDsBytes &&
                  Config::kSmemDqOffset == Config::kSmemPtOffset + Config::kPtBuffers * kDsBytes &&
                  Config::kSmemRowsOffset ==
                      Config::kSmemDqOffset + (kColumnSplit ? 0 : kConsumers * kDqStageBytes) &&
                  Config::kSmemBarrierOffset == Config::kSmemRowsOffset + kStages * 2 * kBlockM * 4,
                  "fagen/model/fa3_bwd.py lays shared memory out the same way");
    static_assert(kQBytes % kAtom == 0 && kKVBytes % kAtom == 0 && kDsBytes % kAtom == 0);

    // Named barrier ids; 0 is __syncthreads.
    enum NamedBarrier : int {
        kDsReady = 1,          // both consumers' dS^T are in shared memory (256 threads)
        kKeyTilesRead = 2,     // both consumers' last products read K and V (256 threads)
        kKeyGradsStaged = 3,   // + consumer: its dK, dV rows are in shared memory (128 threads)
    };

    struct Smem {
        uint32_t base;
        __device__ uint32_t k() const { return base + Config::kSmemKOffset; }
        __device__ uint32_t v() const { return base + Config::kSmemVOffset; }
        __device__ uint32_t q(int st) const { return base + Config::kSmemQOffset + st * kQBytes; }
        __device__ uint32_t dout(int st) const { return base + Config::kSmemDoOffset + st * kQBytes; }
        __device__ uint32_t ds(int buffer) const { return base + Config::kSmemDsOffset + buffer * kDsBytes; }
        __device__ uint32_t pt(int buffer) const { return base + Config::kSmemPtOffset + buffer * kDsBytes; }
        // Box `box` (of kDqBoxColumns) of a consumer's dQ staging for the step in ring slot st:
        // in its own tile (key split), or in its columns of the slot's Q tile (the first half of
        // the boxes) and dO tile (column split: free once its dK and dV read them).
        __device__ uint32_t dq_box(int consumer, int st, int box) const {
            if constexpr (kColumnSplit) {
                constexpr int kHalf = kDqStageBytes / kDqBoxBytes / 2;
                const uint32_t own = consumer * (kQBytes / kConsumers);
                return (box < kHalf ? q(st) : dout(st)) + own + (box % kHalf) * kDqBoxBytes;
            } else {
                return base + Config::kSmemDqOffset + consumer * kDqStageBytes + box * kDqBoxBytes;
            }
        }
        __device__ uint32_t lse(int st) const { return base + Config::kSmemRowsOffset + st * 2 * kBlockM * 4; }
        __device__ uint32_t d(int st) const { return lse(st) + kBlockM * 4; }
        // mbarriers, 8 bytes each: kv_full; the dQ handover (fagen/model/fa3_bwd.py, dq_barriers
        // says why they differ): per consumer dq_full and dq_empty (key split) or per consumer
        // and ring slot dq_full (column split); then per stage full (Q, dO, LSE, D) and empty.
        __device__ uint32_t kv_full() const { return base + Config::kSmemBarrierOffset; }
        __device__ uint32_t dq_full(int consumer, int st) const {
            if constexpr (kColumnSplit) return kv_full() + 8 * (1 + consumer * kStages + st);
            return kv_full() + 8 * (1 + 2 * consumer);
        }
        __device__ uint32_t dq_empty(int consumer) const {
            static_assert(!kColumnSplit);
            return kv_full() + 8 * (2 + 2 * consumer);
        }
        __device__ uint32_t full(int st) const { return kv_full() + 8 * (1 + Config::kDqBarriers + 2 * st); }
        __device__ uint32_t empty(int st) const { return kv_full() + 8 * (2 + Config::kDqBarriers + 2 * st); }
    };

    // ---------------------------------------------------------------- producer
    // The producer warpgroup's roles, each a loop over the CTA's steps (the query heads of the
    // group, then the query blocks): one thread issues the TMA loads (K and V once, Q and dO per
    // step), one warp loads LSE and D, one thread writes dQ. Roles of their own, not one warp
    // doing all: that loop spilled at 40 registers.
    template <class Step>
    static __device__ __forceinline__ void for_each_step(const FagenBwdParams& p, Step&& step) {
        const Walk w = Walk::of_cta(p);
        step.tile(w);
        const int m_blocks = w.i_begin + w.i_count;
        int t = 0;  // ring position
        for (int head = w.kv_head * w.group; head < (w.kv_head + 1) * w.group; ++head) {
            for (int m_block = w.i_begin; m_block < m_blocks; ++m_block, ++t) step.step(w, head, m_block, t);
        }
    }

    struct TmaLoads {
        const FagenBwdTmaMaps& maps;
        const Smem& s;

        __device__ void tile(const Walk& w) const {
            ptx::mbarrier_arrive_expect_tx(s.kv_full(), 2 * kKVBytes);
            const int key_row = w.seq.k_begin() + w.key_begin(), batch = w.seq.tma_batch(w.batch);
            algo::tma_copy_tile<kChunks>(maps.k, s.k(), kBlockN, s.kv_full(), key_row, w.kv_head, batch);
            algo::tma_copy_tile<kChunks>(maps.v, s.v(), kBlockN, s.kv_full(), key_row, w.kv_head, batch);
        }
        __device__ void step(const Walk& w, int head, int m_block, int t) const {
            const int st = t % kStages;
            ptx::mbarrier_wait_parity(s.empty(st), algo::ring_parity<kStages>(t) ^ 1);
            ptx::mbarrier_arrive_expect_tx(s.full(st), 2 * kQBytes);
            const int row = w.seq.q_begin() + m_block * kBlockM, batch = w.seq.tma_batch(w.batch);
            algo::tma_copy_tile<kChunks>(maps.q, s.q(st), kBlockM, s.full(st), row, head, batch);
            algo::tma_copy_tile<kChunks>(maps.dout, s.dout(st), kBlockM, s.full(st), row, head, batch);
        }
    };

    // Each lane arrives on the stage's full barrier after its own stores (the arrival releases
    // them).
    struct RowLoads {
        const FagenBwdParams& p;
        const Smem& s;
        int lane;

        __device__ void tile(const Walk&) const {}
        __device__ void step(const Walk& w, int head, int m_block, int t) const {
            const int st = t % kStages;
            ptx::mbarrier_wait_parity(s.empty(st), algo::ring_parity<kStages>(t) ^ 1);
            const int row_begin = m_block * kBlockM;
            const int rows_valid = w.seq.seqlen_q(p) - row_begin;
            const long long row0 = w.head_row0(p, head) + row_begin;
            float* lse = static_cast<float*>(__cvta_shared_to_generic(s.lse(st)));
            float* dsum = static_cast<float*>(__cvta_shared_to_generic(s.d(st)));
            static_assert(kBlockM == 2 * kRowLoaderLanes);
#pragma unroll
            for (int i = lane; i < kBlockM; i += kRowLoaderLanes) {
                const bool valid = i < rows_valid;
                lse[i] = valid ? p.lse_log2[row0 + i] : -algo::neg_inf();
                dsum[i] = valid ? p.softmax_d[row0 + i] : 0.f;
            }
            ptx::mbarrier_arrive(s.full(st));
        }
    };

    // The dQ writer: per step, once both consumers staged their part of dQ_i, adds them to the
    // accumulator in global memory with TMA reductions and hands the staging tiles back as soon
    // as they are read (the two parts are disjoint columns): to the consumers (key split), or as
    // the ring slot to the loaders (column split). Deterministic mode: first waits for the query
    // block's counter to reach this tile's rank, then waits for the reductions to complete and
    // passes the counter on.
    struct DqWrites {
        const FagenBwdParams& p;
        const FagenBwdTmaMaps& maps;
        const Smem& s;

        __device__ void tile(const Walk&) const {}
        __device__ void step(const Walk& w, int head, int m_block, int t) const {
            const bool ordered = p.dq_semaphore != nullptr;
            int* semaphore = ordered ? Order::semaphore(p, w.batch * p.heads_q + head, m_block) : nullptr;
            if (ordered) {
                const int rank = Order::rank(w.mask(p), m_block, w.n_block);
                while (atomicAdd(semaphore, 0) != rank) {
                }
                __threadfence();
                ptx::fence_proxy_async_global();  // the reductions below come after the wait
            }
#pragma unroll
            for (int consumer = 0; consumer < kConsumers; ++consumer) {
                ptx::mbarrier_wait_parity(s.dq_full(consumer, t % kStages),
                                          kColumnSplit ? algo::ring_parity<kStages>(t) : t & 1);
                const int col0 = consumer * kDqColumns;
#pragma unroll
                for (int box = 0; box < kDqColumns / kDqBoxColumns; ++box) {
                    ptx::cp_reduce_async_bulk_tensor_4d_add(&maps.dq_accum, s.dq_box(consumer, t % kStages, box),
                                                            col0 + box * kDqBoxColumns,
                                                            w.seq.accum_begin(w.batch) + m_block * kBlockM, head,
                                                            w.seq.tma_batch(w.batch));
                }
                ptx::cp_async_bulk_commit_group();
            }
            ptx::cp_async_bulk_wait_group_read<0>();
            if constexpr (kColumnSplit) {
                ptx::mbarrier_arrive(s.empty(t % kStages));
            } else {
#pragma unroll
                for (int consumer = 0; consumer < kConsumers; ++consumer) ptx::mbarrier_arrive(s.dq_empty(consumer));
            }
            if (ordered) {
                ptx::cp_async_bulk_wait_group<0>();
                __threadfence();
                atomicAdd(semaphore, 1);
            }
        }
    };

    // ---------------------------------------------------------------- consumer
    // wgmma descriptors at stage 0, k-step 0, built once and advanced per use. Four are kept;
    // the others differ from them by constants (V follows K and dO the Q stages in shared
    // memory; the MN-major reads of Q and dO differ from the K-major ones in the leading byte
    // offset only), which keeps 8 registers free (the causal head_dim 128 kernel spilled with
    // all eight).
    struct Descriptors {
        unsigned long long k_a;   // A of S^T: this consumer's 64 keys of K (K-major)
        unsigned long long q_b;   // B of S^T: Q (K-major, N = queries)
        unsigned long long ds_a;  // A of dQ: dS read MN-major from the dS^T tile (M = queries)
        unsigned long long k_bt;  // B of dQ: K read MN-major (N = head_dim, K = keys)

        static constexpr unsigned long long kMnMajor =
            static_cast<unsigned long long>(((kBlockM * 128) >> 4) - (16 >> 4)) << 16;
        __device__ unsigned long long v_a() const { return k_a + (kKVBytes >> 4); }  // A of dP^T
        __device__ unsigned long long do_b() const { return q_b + ((kStages * kQBytes) >> 4); }  // B of dP^T
        __device__ unsigned long long q_bt() const { return q_b + kMnMajor; }  // B of dK: Q MN-major
        __device__ unsigned long long do_bt() const { return do_b() + kMnMajor; }  // B of dV
    };

    static __device__ Descriptors descriptors(const Smem& s, int consumer) {
        static_assert(Config::kSmemVOffset == Config::kSmemKOffset + kKVBytes &&
                      Config::kSmemDoOffset == Config::kSmemQOffset + kStages * kQBytes);
        const uint32_t own_rows = consumer * kConsumerKeys * 128;
        // This consumer's dQ columns of K: column chunk (of kBlockN rows of 128 bytes), then the
        // byte offset inside a swizzled row (the swizzle is a function of the address, so a
        // start 64 bytes into the row reads columns 32-63 of the chunk).
        const uint32_t dq_col = consumer * kDqColumns;
        const uint32_t dq_cols_at = (dq_col / 64) * kBlockN * 128 + (dq_col % 64) * 2;
        return {ptx::wgmma_desc_swizzle128(s.k() + own_rows, 16, kAtom),
                ptx::wgmma_desc_swizzle128(s.q(0), 16, kAtom),
                ptx::wgmma_desc_swizzle128(s.ds(0), kDsBytes, kAtom),
                ptx::wgmma_desc_swizzle128(s.k() + dq_cols_at, kBlockN * 128, kAtom)};
    }

    // acc (this consumer's 64 keys x its kScoreQueries queries) = rows of `a` (K or V) times the
    // rows of `b` (Q or dO of stage st), transposed.
    static __device__ __forceinline__ void issue_scores(float (&acc)[kSTiles][4], unsigned long long a,
                                                        unsigned long long b, int st) {
#pragma unroll
        for (int kk = 0; kk < kQKSteps; ++kk) {
            const int chunk = kk / 4;
            const uint32_t k_offset = (kk % 4) * 32;  // 16 columns = 32 bytes into the row
            ptx::wgmma_ss<kScoreQueries, Config::kIsBf16, 0>(
                acc, ptx::wgmma_desc_advance(a, chunk * kBlockN * 128 + k_offset),
                ptx::wgmma_desc_advance(b, st * kQBytes + chunk * kBlockM * 128 + k_offset), kk > 0);
        }
        ptx::wgmma_commit_group();
    }

    // acc (64 keys x head_dim) += frags (64 keys x 64 queries, A fragments) times Q or dO of
    // stage st (queries x head_dim).
    static __device__ __forceinline__ void issue_key_grads(float (&acc)[kKVTiles][4],
                                                           const uint32_t (&frags)[kQuerySteps][4],
                                                           unsigned long long bt, int st) {
#pragma unroll
        for (int kk = 0; kk < kQuerySteps; ++kk) {
            ptx::wgmma_rs<kHeadDim, Config::kIsBf16, 1>(
                acc, frags[kk], ptx::wgmma_desc_advance(bt, st * kQBytes + kk * 16 * 128), 1);
        }
    }

    // P^T = exp2(S^T scale_log2 - LSE) in place, the scores modified first (`score`; the warp's
    // keys from first_key, the queries from first_query); `lse` holds the LSE of the consumer's
    // first query on. The two queries (columns) of a thread's pair in an n8 tile: one 8-byte load.
    static __device__ __forceinline__ void probabilities(float (&acc)[kSTiles][4],
                                                         uint32_t (&dsoftcap)[kSoftcapTiles][2], const Score& score,
                                                         int first_key, int first_query, const float* lse,
                                                         float scale_log2, int lane) {
#pragma unroll
        for (int n = 0; n < kSTiles; ++n) {
            const float2 lse_pair = *reinterpret_cast<const float2*>(lse + algo::fragment_coord(lane, 0, n, 0).col);
            float grads[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const algo::FragmentCoord f = algo::fragment_coord(lane, 0, n, i);
                float u = acc[n][i];
                if constexpr (!Score::kIdentity) u = score.modify(u, first_query + f.col, first_key + f.row, grads[i]);
                acc[n][i] = ptx::ex2_approx_ftz(
                    algo::backward_exponent(u, scale_log2, i & 1 ? lse_pair.y : lse_pair.x));
            }
            if constexpr (Config::kSoftcap) {
                dsoftcap[n][0] = DsoftcapOps::pack(grads[0], grads[1]);
                dsoftcap[n][1] = DsoftcapOps::pack(grads[2], grads[3]);
            }
        }
    }

    // dS^T = P^T (dP^T - D) in place in dP^T's n8 tile n (times the softcap's 1 - u^2); `dsum`
    // holds D from the consumer's first query on.
    static __device__ __forceinline__ void score_grads(float (&dp)[kSTiles][4], const float (&probs)[kSTiles][4],
                                                       const uint32_t (&dsoftcap)[kSoftcapTiles][2],
                                                       const float* dsum, int n, int lane) {
        const float2 d_pair = *reinterpret_cast<const float2*>(dsum + algo::fragment_coord(lane, 0, n, 0).col);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            dp[n][i] = probs[n][i] * (dp[n][i] - (i & 1 ? d_pair.y : d_pair.x));
            if constexpr (Config::kSoftcap) {
                const float2 grads = DsoftcapOps::unpack(dsoftcap[n][i / 2]);
                dp[n][i] *= i & 1 ? grads.y : grads.x;
            }
        }
    }

    // dS^T or P^T (this consumer's rows of the accumulator layout, its queries from first_col on)
    // into a swizzled tile of 64 queries: row r, 16-byte chunk c at chunk c ^ (r % 8). A warp's
    // stores of one n8 tile cover 8 rows x 16 bytes in 8 distinct chunks: all 32 banks, no
    // conflict.
    static __device__ __forceinline__ void store_ds(uint32_t tile, const float (&ds)[kSTiles][4],
                                                    int first_row, int first_col, int lane) {
#pragma unroll
        for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const algo::FragmentCoord f = algo::fragment_coord(lane, 0, n, 2 * h);
                const int row = first_row + f.row;
                const uint32_t byte = (first_col + f.col) * 2;
                const uint32_t at = row * 128 + ((((byte / 16) ^ (row % 8)) * 16) | (byte % 16));
                *static_cast<uint32_t*>(__cvta_shared_to_generic(tile + at)) =
                    Ops::pack(ds[n][2 * h], ds[n][2 * h + 1]);
            }
        }
    }

    // A consumer's part of dQ_i (64 rows x kDqColumns) into its staging (Smem::dq_box): TMA boxes
    // of 32 fp32 columns, each 64 rows of 128 bytes with the 128-byte swizzle (16-byte chunk c of
    // row r at c ^ r % 8). A warp's float2 stores of one n8 tile cover 8 rows x 32 bytes in two
    // wavefronts.
    static __device__ __forceinline__ void store_dq_stage(const Smem& s, int consumer, int st,
                                                          const float (&acc)[kDqTiles][4], int warp, int lane) {
#pragma unroll
        for (int n = 0; n < kDqTiles; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const algo::FragmentCoord f = algo::fragment_coord(lane, 0, n, 2 * h);
                const int row = warp * 16 + f.row;
                const uint32_t byte = (f.col % kDqBoxColumns) * 4;
                const uint32_t at = s.dq_box(consumer, st, f.col / kDqBoxColumns) + row * 128 +
                                    ((((byte / 16) ^ (row % 8)) * 16) | (byte % 16));
                *static_cast<float2*>(__cvta_shared_to_generic(at)) =
                    make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
            }
        }
    }

    // ---------------------------------------------------------------- epilogue
    // dK and dV leave through shared memory, in the K and V tiles (read for the last time by
    // then): the accumulator layout's 4-byte stores wrote 16 bytes of each of 8 rows per warp
    // instruction, and took 2.1 us of a 31 us tile at head_dim 64, causal 2k (run 89).

    // scale * acc (a warp's 16 rows from `row`, kKVTiles n8 tiles of columns from col0) as the
    // element type into the swizzled tile at `tile` (TMA's layout of K and V: chunks of 64 columns
    // of kBlockN rows of 128 bytes, 16-byte piece j of row r at j ^ r % 8, so a warp's stores of
    // one n8 tile hit 8 distinct bank groups).
    static __device__ __forceinline__ void stage_key_rows(uint32_t tile, const float (&acc)[kKVTiles][4],
                                                          float scale, int row, int col0, int lane) {
#pragma unroll
        for (int n = 0; n < kKVTiles; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const algo::FragmentCoord f = algo::fragment_coord(lane, 0, n, 2 * h);
                const int r = row + f.row, col = col0 + f.col;
                const uint32_t byte = (col % 64) * 2;
                const uint32_t at = (col / 64) * kBlockN * 128 + r * 128 + ((((byte / 16) ^ (r % 8)) * 16) | (byte % 16));
                *static_cast<uint32_t*>(__cvta_shared_to_generic(tile + at)) =
                    Ops::pack(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
            }
        }
    }

    // Rows [row0, row0 + 64) x columns [col0, col0 + kGradColumns) of a staged tile to `out` (the
    // tile's (batch, K/V head) origin, its first key at row 0 of the tile) in 16-byte pieces, so
    // that a warp writes whole 128-byte row segments; rows past seqlen_k left out.
    static __device__ __forceinline__ void copy_key_rows(int seqlen_k, Element* out, long long row_stride,
                                                         uint32_t tile, int key0, int row0, int col0, int thread) {
        constexpr int kPieces = kGradColumns / 8;  // 16-byte pieces of a row
        static_assert((64 * kPieces) % 128 == 0);
#pragma unroll
        for (int i = thread; i < 64 * kPieces; i += 128) {
            const int r = row0 + i / kPieces, col = col0 + (i % kPieces) * 8;
            const uint32_t at = (col / 64) * kBlockN * 128 + r * 128 + ((((col % 64) / 8) ^ (r % 8)) * 16);
            const uint4 piece = *static_cast<const uint4*>(__cvta_shared_to_generic(tile + at));
            const int key = key0 + r;
            if (key < seqlen_k) *reinterpret_cast<uint4*>(out + key * row_stride + col) = piece;
        }
    }

    // A consumer's dK and dV rows, once both consumers are done with K and V.
    static __device__ void store_key_grads(const FagenBwdParams& p, const Smem& s, const Walk& w,
                                           const float (&acc_dk)[kKVTiles][4], const float (&acc_dv)[kKVTiles][4],
                                           int consumer, int warp, int lane, int thread) {
        const int row0 = kColumnSplit ? 0 : consumer * kConsumerKeys;
        const int col0 = kColumnSplit ? consumer * kGradColumns : 0;
        ptx::bar_sync(kKeyTilesRead, kConsumerThreads);
        stage_key_rows(s.k(), acc_dk, p.softmax_scale, row0 + warp * 16, col0, lane);
        stage_key_rows(s.v(), acc_dv, 1.f, row0 + warp * 16, col0, lane);
        ptx::bar_sync(kKeyGradsStaged + consumer, 128);
        // The batch row read again rather than kept through the walk (varlen: registers the
        // column split's loop spilled without).
        const Row seq = Row::of(p, w.batch);
        copy_key_rows(seq.seqlen_k(p),
                      static_cast<Element*>(p.dk) + w.batch * p.dk_batch_stride + w.kv_head * p.dk_head_stride +
                          seq.k_begin() * p.dk_row_stride,
                      p.dk_row_stride, s.k(), w.key_begin(), row0, col0, thread);
        copy_key_rows(seq.seqlen_k(p),
                      static_cast<Element*>(p.dv) + w.batch * p.dv_batch_stride + w.kv_head * p.dv_head_stride +
                          seq.k_begin() * p.dv_row_stride,
                      p.dv_row_stride, s.v(), w.key_begin(), row0, col0, thread);
    }

    // The key split's consumer: its own 64 keys, every column.
    template <bool kMayMask>
    static __device__ void consume_keys(const FagenBwdParams& p, const Smem& s, int consumer, int thread) {
        const int warp = thread / 32, lane = thread % 32;
        const Descriptors desc = descriptors(s, consumer);
        const Walk w = Walk::of_cta(p);
        const Mask mask = w.mask(p);
        const int first_key = w.key_begin() + consumer * kConsumerKeys + warp * 16;  // this warp's

        float acc_dk[kKVTiles][4];
        float acc_dv[kKVTiles][4];
        algo::clear_fragment(acc_dk);
        algo::clear_fragment(acc_dv);

        ptx::mbarrier_wait_parity(s.kv_full(), 0);
        // The steps: query heads of the group outer, query blocks inner (algo::StepCursor).
        const int head_end = (w.kv_head + 1) * w.group, m_end = w.i_begin + w.i_count;
        algo::StepCursor at{w.kv_head * w.group, w.i_begin};
#pragma unroll 1
        for (int t = 0; m_end > w.i_begin && at.head < head_end; ++t, at.advance(w.i_begin, m_end)) {
            const int head = at.head, m_block = at.block;
            const int st = t % kStages;
            const int row_begin = m_block * kBlockM;
            ptx::mbarrier_wait_parity(s.full(st), algo::ring_parity<kStages>(t));

            float acc_s[kSTiles][4];
            float acc_dp[kSTiles][4];
            ptx::wgmma_fence();
            issue_scores(acc_s, desc.k_a, desc.q_b, st);
            issue_scores(acc_dp, desc.v_a(), desc.do_b(), st);

            const float* lse = static_cast<const float*>(__cvta_shared_to_generic(s.lse(st)));
            const float* dsum = static_cast<const float*>(__cvta_shared_to_generic(s.d(st)));
            const bool needs_mask = kMayMask && mask.block_needs_mask(first_key / 16, row_begin, kBlockM, 16);
            ptx::wgmma_wait_group<1>();
            ptx::fence_accumulators(acc_s);
            uint32_t p_frags[kQuerySteps][4];
            uint32_t dsoftcap[kSoftcapTiles][2];
            probabilities(acc_s, dsoftcap, Score::of(p, w.batch, head, mask.seqlen_q, mask.seqlen_k), first_key, row_begin, lse, p.scale_log2, lane);
            if (needs_mask) algo::zero_masked_probs(mask, acc_s, lane, first_key, row_begin);

            // dS^T, and both P^T and dS^T packed into A fragments one k16 step at a time, so that
            // the fp32 P^T dies as its fragments fill (packing P^T first, before dP^T arrived, kept
            // both whole and spilled 12 bytes at head_dim 128, causal).
            ptx::wgmma_wait_group<0>();
            ptx::fence_accumulators(acc_dp);
            uint32_t ds_frags[kQuerySteps][4];
#pragma unroll
            for (int kk = 0; kk < kQuerySteps; ++kk) {
#pragma unroll
                for (int n = 2 * kk; n < 2 * kk + 2; ++n) score_grads(acc_dp, acc_s, dsoftcap, dsum, n, lane);
                algo::pack_a_fragment<Element>(p_frags[kk], acc_s, kk);
                algo::pack_a_fragment<Element>(ds_frags[kk], acc_dp, kk);
            }
            const int buffer = t % 2;
            store_ds(s.ds(buffer), acc_dp, consumer * kConsumerKeys + warp * 16, 0, lane);

            // dV, then dQ once every dS^T it reads is in shared memory, then dK: dQ's additions
            // to global memory run while the tensor cores work through dK.
            ptx::fence_accumulators(acc_dv);
            ptx::fence_accumulators(acc_dk);
            ptx::wgmma_fence();
            issue_key_grads(acc_dv, p_frags, desc.do_bt(), st);
            ptx::wgmma_commit_group();
            ptx::fence_proxy_async_shared_cta();  // dS^T was written through the generic proxy
            ptx::bar_sync(kDsReady, kConsumerThreads);
            float acc_dq[kDqTiles][4];
            ptx::wgmma_fence();
            issue_dq(acc_dq, desc.ds_a, desc.k_bt, buffer);
            issue_key_grads(acc_dk, ds_frags, desc.q_bt(), st);
            ptx::wgmma_commit_group();
            ptx::wgmma_wait_group<1>();  // dV and dQ; dK runs on
            ptx::fence_accumulators(acc_dq);
            // dQ_i into this consumer's staging tile once the dQ writer has read the previous
            // step's (it was handed over a step ago, so this rarely waits), then to the writer.
            ptx::mbarrier_wait_parity(s.dq_empty(consumer), (t & 1) ^ 1);
            store_dq_stage(s, consumer, st, acc_dq, warp, lane);
            ptx::fence_proxy_async_shared_cta();
            ptx::mbarrier_arrive(s.dq_full(consumer, st));
            ptx::wgmma_wait_group<0>();  // dK
            ptx::fence_accumulators(acc_dv);
            ptx::fence_accumulators(acc_dk);
            ptx::mbarrier_arrive(s.empty(st));  // Q_i, dO_i, LSE_i, D_i are read
        }

        // The tile's walk again rather than kept across the loop: at head_dim 128, causal, the
        // kept copy spilled.
        store_key_grads(p, s, Walk::of_cta(p), acc_dk, acc_dv, consumer, warp, lane, thread);
    }

    // acc (64 queries x this consumer's kDqColumns) = dS (read MN-major from dS^T buffer
    // `buffer`) times K's columns at k_bt (MN-major, N = columns, K = the tile's keys).
    static __device__ __forceinline__ void issue_dq(float (&acc)[kDqTiles][4], unsigned long long ds_a,
                                                    unsigned long long k_bt, int buffer) {
#pragma unroll
        for (int kk = 0; kk < kDqKeySteps; ++kk) {
            ptx::wgmma_ss<kDqColumns, Config::kIsBf16, 1, 1>(
                acc, ptx::wgmma_desc_advance(ds_a, buffer * kDsBytes + kk * 16 * 128),
                ptx::wgmma_desc_advance(k_bt, kk * 16 * 128), kk > 0);
        }
        ptx::wgmma_commit_group();
    }

    // acc (64 keys x kGradColumns) += a (P^T or dS^T from shared memory, K-major: keys x 64
    // queries) times bt (this consumer's columns of Q or dO of stage st, MN-major).
    static __device__ __forceinline__ void issue_key_grads_ss(float (&acc)[kKVTiles][4], unsigned long long a,
                                                              unsigned long long bt, int st) {
#pragma unroll
        for (int kk = 0; kk < kQuerySteps; ++kk) {
            ptx::wgmma_ss<kGradColumns, Config::kIsBf16, 1>(
                acc, ptx::wgmma_desc_advance(a, kk * 32), ptx::wgmma_desc_advance(bt, st * kQBytes + kk * 16 * 128), 1);
        }
        ptx::wgmma_commit_group();
    }

    // The column split's consumer: the tile's 64 keys, its kGradColumns columns of dK, dV and dQ,
    // and the scores of its half of each step's queries. Per step: S^T, dP^T of its queries; P^T
    // and dS^T into shared memory; once both consumers' are there, dV, dK and dQ from them; then
    // its part of dQ into its columns of the step's Q and dO tiles (read by now), for the writer,
    // which frees the ring slot.
    template <bool kMayMask>
    static __device__ void consume_columns(const FagenBwdParams& p, const Smem& s, int consumer, int thread) {
        static_assert(kColumnSplit);
        const int warp = thread / 32, lane = thread % 32;
        const Walk w = Walk::of_cta(p);
        const Mask mask = w.mask(p);
        const int first_key = w.key_begin() + warp * 16;  // this warp's 16 keys
        const int own_query = consumer * kScoreQueries;   // this consumer's first query of a step
        const uint32_t own_columns = consumer * (kQBytes / kConsumers);  // its chunks of a Q or dO tile
        constexpr uint32_t kDoAfterQ = kStages * kQBytes;
        static_assert(Config::kSmemDoOffset == Config::kSmemQOffset + kDoAfterQ &&
                      Config::kSmemVOffset == Config::kSmemKOffset + kKVBytes);
        // S^T, dP^T: K, V (A, K-major) by this consumer's query rows of Q, dO (B, K-major).
        const unsigned long long k_a = ptx::wgmma_desc_swizzle128(s.k(), 16, kAtom);
        const unsigned long long v_a = ptx::wgmma_desc_advance(k_a, kKVBytes);
        const unsigned long long q_b = ptx::wgmma_desc_swizzle128(s.q(0) + own_query * 128, 16, kAtom);
        const unsigned long long do_b = ptx::wgmma_desc_advance(q_b, kDoAfterQ);
        // dV, dK: P^T, dS^T (A, K-major) by this consumer's columns of dO, Q (B, MN-major).
        const unsigned long long pt_a = ptx::wgmma_desc_swizzle128(s.pt(0), 16, kAtom);
        const unsigned long long ds_ka = ptx::wgmma_desc_swizzle128(s.ds(0), 16, kAtom);
        const unsigned long long q_bt = ptx::wgmma_desc_swizzle128(s.q(0) + own_columns, kBlockM * 128, kAtom);
        const unsigned long long do_bt = ptx::wgmma_desc_advance(q_bt, kDoAfterQ);
        // dQ: dS read MN-major from the dS^T tile (A) by this consumer's columns of K (B, MN-major).
        const unsigned long long ds_a = ptx::wgmma_desc_swizzle128(s.ds(0), kDsBytes, kAtom);
        const unsigned long long k_bt = ptx::wgmma_desc_swizzle128(
            s.k() + consumer * (kDqColumns / 64) * kBlockN * 128, kBlockN * 128, kAtom);

        float acc_dk[kKVTiles][4];
        float acc_dv[kKVTiles][4];
        algo::clear_fragment(acc_dk);
        algo::clear_fragment(acc_dv);

        ptx::mbarrier_wait_parity(s.kv_full(), 0);
        const int head_end = (w.kv_head + 1) * w.group, m_end = w.i_begin + w.i_count;
        algo::StepCursor at{w.kv_head * w.group, w.i_begin};
#pragma unroll 1
        for (int t = 0; m_end > w.i_begin && at.head < head_end; ++t, at.advance(w.i_begin, m_end)) {
            const int head = at.head, m_block = at.block;
            const int st = t % kStages;
            const int buffer = t % 2;
            const int query_begin = m_block * kBlockM + own_query;
            ptx::mbarrier_wait_parity(s.full(st), algo::ring_parity<kStages>(t));

            float acc_s[kSTiles][4];
            float acc_dp[kSTiles][4];
            ptx::wgmma_fence();
            issue_scores(acc_s, k_a, q_b, st);
            issue_scores(acc_dp, v_a, do_b, st);

            const float* lse = static_cast<const float*>(__cvta_shared_to_generic(s.lse(st))) + own_query;
            const float* dsum = static_cast<const float*>(__cvta_shared_to_generic(s.d(st))) + own_query;
            const bool needs_mask = kMayMask && mask.block_needs_mask(first_key / 16, query_begin, kScoreQueries, 16);
            ptx::wgmma_wait_group<1>();
            ptx::fence_accumulators(acc_s);
            uint32_t dsoftcap[kSoftcapTiles][2];
            probabilities(acc_s, dsoftcap, Score::of(p, w.batch, head, mask.seqlen_q, mask.seqlen_k), first_key, query_begin, lse, p.scale_log2, lane);
            if (needs_mask) algo::zero_masked_probs(mask, acc_s, lane, first_key, query_begin);
            ptx::wgmma_wait_group<0>();
            ptx::fence_accumulators(acc_dp);
#pragma unroll
            for (int n = 0; n < kSTiles; ++n) score_grads(acc_dp, acc_s, dsoftcap, dsum, n, lane);
            store_ds(s.pt(buffer), acc_s, warp * 16, own_query, lane);
            store_ds(s.ds(buffer), acc_dp, warp * 16, own_query, lane);
            ptx::fence_proxy_async_shared_cta();  // P^T, dS^T were written through the generic proxy
            ptx::bar_sync(kDsReady, kConsumerThreads);

            ptx::fence_accumulators(acc_dv);
            ptx::fence_accumulators(acc_dk);
            ptx::wgmma_fence();
            issue_key_grads_ss(acc_dv, ptx::wgmma_desc_advance(pt_a, buffer * kDsBytes), do_bt, st);
            issue_key_grads_ss(acc_dk, ptx::wgmma_desc_advance(ds_ka, buffer * kDsBytes), q_bt, st);
            float acc_dq[kDqTiles][4];
            issue_dq(acc_dq, ds_a, k_bt, buffer);
            ptx::wgmma_wait_group<0>();  // dV and dK read the columns dQ is staged in
            ptx::fence_accumulators(acc_dv);
            ptx::fence_accumulators(acc_dk);
            ptx::fence_accumulators(acc_dq);
            store_dq_stage(s, consumer, st, acc_dq, warp, lane);
            ptx::fence_proxy_async_shared_cta();
            ptx::mbarrier_arrive(s.dq_full(consumer, st));
        }

        store_key_grads(p, s, w, acc_dk, acc_dv, consumer, warp, lane, thread);
    }

    // ---------------------------------------------------------------- entry
    // Each role is one branch holding its setmaxnreg (fa3/forward.cuh, run, says why).
    static __device__ void run(const FagenBwdParams& p, const FagenBwdTmaMaps& maps, char* smem) {
        const Smem s{algo::swizzle_aligned_base(smem)};
        if (threadIdx.x == 0) {
            ptx::prefetch_tensormap(&maps.q);
            ptx::prefetch_tensormap(&maps.k);
            ptx::prefetch_tensormap(&maps.v);
            ptx::prefetch_tensormap(&maps.dout);
            ptx::prefetch_tensormap(&maps.dq_accum);
            ptx::mbarrier_init(s.kv_full(), 1);
            for (int consumer = 0; consumer < kConsumers; ++consumer) {
                if constexpr (kColumnSplit) {
                    for (int st = 0; st < kStages; ++st) ptx::mbarrier_init(s.dq_full(consumer, st), 128);
                } else {
                    ptx::mbarrier_init(s.dq_full(consumer, 0), 128);
                    ptx::mbarrier_init(s.dq_empty(consumer), 1);
                }
            }
            for (int st = 0; st < kStages; ++st) {
                ptx::mbarrier_init(s.full(st), kRowLoaderLanes + 1);  // + the TMA thread
                // Freed by the consumers (key split) or by the dQ writer once it read the dQ
                // staged in the slot (column split).
                ptx::mbarrier_init(s.empty(st), kColumnSplit ? 1 : kConsumerThreads);
            }
            ptx::fence_mbarrier_init_release_cluster();
        }
        __syncthreads();
        if (threadIdx.x < 128) {
            ptx::setmaxnreg_dec<Config::kProducerRegisters>();
            if (threadIdx.x == 0) {
                for_each_step(p, TmaLoads{maps, s});
            } else if (threadIdx.x / 32 == 1) {
                for_each_step(p, RowLoads{p, s, static_cast<int>(threadIdx.x % 32)});
            } else if (threadIdx.x == 64) {
                for_each_step(p, DqWrites{p, maps, s});
                ptx::cp_async_bulk_wait_group<0>();  // the last reductions, before the CTA exits
            }
        } else {
            ptx::setmaxnreg_inc<Config::kConsumerRegisters>();
            // A tile whose steps may need the mask (an edge, or keys past seqlen_k, which are TMA's
            // zero rows: their score 0 gives exp2(-LSE2), inf for a row whose LSE is far below 0,
            // and inf * 0 = NaN in dQ) runs the loop with it, every other tile the loop without:
            // with the mask's branch in every non-causal tile the backward ran at 0.91-0.97x at
            // head dims 64/128 (2026-12-01).
            const Walk w = Walk::of_cta(p);
            const bool may_mask = w.mask(p).tile_may_need_mask(w.key_begin(), kBlockN);
            const int consumer = threadIdx.x / 128 - 1, thread = threadIdx.x % 128;
            if constexpr (kColumnSplit) {
                may_mask ? consume_columns<true>(p, s, consumer, thread) : consume_columns<false>(p, s, consumer, thread);
            } else {
                may_mask ? consume_keys<true>(p, s, consumer, thread) : consume_keys<false>(p, s, consumer, thread);
            }
        }
    }
};

}  // namespace fagen::fa3
