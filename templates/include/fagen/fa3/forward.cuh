// FlashAttention-3 forward on Hopper (sm_90a): TMA loads into an mbarrier-guarded shared-memory
// ring, wgmma with fp32 accumulators in registers, warp specialization with register
// reallocation, the softmax of block j overlapped with P_{j-1} V_{j-1} inside each warpgroup,
// optional ping-pong scheduling between the two consumer warpgroups (FlashAttention-3 paper,
// sections 3.1 and 3.2), and a persistent grid. Dense, varlen (Config::kVarlen:
// algo/batch_row.cuh; a varlen map spans the packed rows, batch 1) or paged (Config::kPaged: a
// KV-cache call's prefill, its K/V tiles loaded in runs of keys through the block table,
// algo/tma_tile.cuh: cache_runs, or where pages hold no whole tile gathered by the producer
// warpgroup, algo/cache_gather.cuh).
//
// The element is fp16, bf16 or e4m3 (FP8, FlashAttention-3 paper section 3.3): with e4m3 both
// products run on the 8-bit wgmma (k32), the scores and O are scaled by the call's descales
// (FagenFwdParams.q_descale ...), P is rounded to e4m3 with the softmax's probability offset
// (algo/online_softmax.cuh), the output is bf16 (Config::Output), and since 8-bit wgmma takes
// its B operand K-major only, P V reads V^T tiles, which TMA loads from the V^T that the
// kernel's companion wrote into the call's workspace (algo/v_transpose.cuh); the V map is over
// that V^T.
//
// Roles (warpgroup = 128 threads):
//   producer  (warpgroup 0): one thread issues every TMA load (paged, gathering: all 128 copy
//             K/V rows, thread 0 loads Q).
//   consumers (the others: 2 or 3 warpgroups of 64 query rows each): S = Q K^T (wgmma, both
//             operands in shared memory), online softmax, O += P V (wgmma, P from registers),
//             epilogue.
// Every CTA walks several tiles: the producer loads the next tile's Q and K/V while the
// consumers still compute and store the current one; ring positions and barrier phases run on
// across tiles. With kEarlyFirstQk a consumer also issues the next tile's first Q K^T before
// this tile's epilogue (S is free once the last P is in registers), so that the tensor cores
// work through it.
//
// What every shipped kernel does is structure here, not a flag. The measurements that made it
// so (docs/performance.md, "Ideas tried"): the producer warpgroup and the overlap each beat
// their absence in every row of the run-1 ablation, the persistent grid beat one tile per CTA
// at every length (runs 2, 20), and one-consumer tiles (two CTAs per SM) stayed below the
// two-consumer ones (run 23).
//
// Shared memory (every tile 1024-byte aligned for the 128-byte swizzle): kQStages Q tiles (two
// with kEarlyFirstQk, so that the next tile's Q is loaded a tile ahead), then kStages K tiles,
// then kStages V stages (a V tile; with e4m3 a V^T tile), then the mbarriers. A
// tile of R rows x D columns (Q and K: head_dim; V: head_dim_v) is D/kChunkColumns column chunks,
// each R rows of 128 bytes, as TMA writes them.
#pragma once

#include "fagen/algo/cache_gather.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/online_softmax.cuh"
#include "fagen/algo/tile_output.cuh"
#include "fagen/algo/tile_scheduler.cuh"
#include "fagen/algo/tma_tile.cuh"
#include "fagen/algo/descale.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/algo/v_transpose.cuh"
#include "fagen/params.h"
#include "fagen/ptx/bar.cuh"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/setmaxnreg.cuh"
#include "fagen/ptx/wgmma.cuh"
#include "fagen/ptx/wgmma_desc.cuh"
#include "fagen/ptx/wgmma_sync.cuh"
#include "fagen/types.cuh"

namespace fagen::fa3 {

// Named barrier ids; 0 is __syncthreads.
enum NamedBarrier : int {
    kSchedulerBarrierBase = 1,  // + consumer index: "your turn to issue MMAs" (ping-pong)
    kConsumerBarrierBase = 3,   // + consumer index: the consumer warpgroup's own 128 threads
};

template <class Config>
struct Forward {
    using Element = typename Config::Element;  // q, k, v
    using Output = typename Config::Output;    // o: Element, or bf16 for e4m3
    using Ops = algo::ElementOps<Element>;
    using OutOps = algo::ElementOps<Output>;

    static constexpr int kElementBytes = sizeof(Element);
    static constexpr bool kE4m3 = kElementBytes == 1;  // also: P V reads V^T (see the top of this file)
    static constexpr int kHeadDim = Config::kHeadDim;    // Q and K columns
    static constexpr int kHeadDimV = Config::kHeadDimV;  // V and O columns
    static constexpr int kBlockM = Config::kBlockM;
    static constexpr int kBlockN = Config::kBlockN;
    static constexpr int kStages = Config::kStages;
    static constexpr int kQStages = Config::kQStages;
    static constexpr int kConsumers = kBlockM / 64;
    static constexpr int kConsumerThreads = kConsumers * 128;
    static constexpr int kChunkColumns = 128 / kElementBytes;    // columns of a 128-byte chunk
    static constexpr int kChunks = kHeadDim / kChunkColumns;     // 128-byte column chunks of Q, K
    static constexpr int kVChunks = kHeadDimV / kChunkColumns;   // and of V
    static constexpr int kSTiles = kBlockN / 8;          // n8 tiles of S per warp
    static constexpr int kOTiles = kHeadDimV / 8;        // n8 tiles of O per warp
    // n8 tiles of the O accumulator: O, and with kMmaRowSum the row sums of P after it.
    static constexpr int kOAccTiles = Config::kPVColumns / 8;
    static constexpr int kPSteps = kBlockN / algo::kPvStepKeys<Element>;  // k-steps of P V
    static constexpr int kQKSteps = kHeadDim * kElementBytes / 32;         // 32-byte k-steps of Q K^T
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * kElementBytes;
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * kElementBytes;   // a K tile
    // A V tile, or with e4m3 a V^T tile: kVtChunks chunks of kHeadDimV rows of 128 keys (192
    // keys: two, the second's last 64 unread).
    static constexpr int kVtChunks = Config::kVtChunks;
    static constexpr uint32_t kVBytes = kE4m3 ? kVtChunks * kHeadDimV * 128 : kBlockN * kHeadDimV * kElementBytes;
    static constexpr uint32_t kSwizzleAtomBytes = algo::kSwizzleAtomBytes;
    static constexpr int kRowLayout = Config::kPaged ? algo::kPagedRows : Config::kVarlen ? algo::kVarlenRows
                                                                                           : algo::kDenseRows;

    static_assert(kBlockM % 64 == 0 && kConsumers >= 2 && kConsumers <= 3);
    static_assert(kHeadDim % kChunkColumns == 0 && kHeadDimV % kChunkColumns == 0,
                  "TMA boxes and swizzle atoms are 128 bytes wide");
    static_assert(kBlockN % 16 == 0);
    static_assert(Config::kThreads == (kConsumers + 1) * 128, "a producer warpgroup + the consumers");
    static_assert(!Config::kPingpong || kConsumers == 2, "ping-pong alternates two consumers");
    static_assert(Config::kSmemQOffset % kSwizzleAtomBytes == 0 &&
                  Config::kSmemKOffset % kSwizzleAtomBytes == 0 &&
                  Config::kSmemVOffset % kSwizzleAtomBytes == 0);
    static_assert(Config::kSmemKOffset == Config::kSmemQOffset + kQStages * kQBytes);
    static_assert(Config::kSmemVOffset == Config::kSmemKOffset + kStages * kKVBytes);
    static_assert(Config::kSmemVStageBytes == kVBytes + (Config::kMmaRowSum ? kBlockN * 128 : 0));
    static_assert(Config::kSmemBarrierOffset ==
                  Config::kSmemVOffset + kStages * Config::kSmemVStageBytes);
    static_assert(!Config::kEarlyFirstQk || !Config::kPingpong,
                  "the next tile's first Q K^T goes out outside the ping-pong turns");
    static_assert(!Config::kPaged || (!Config::kVarlen && kBlockN % Config::kCacheBoxRows == 0),
                  "a paged K/V tile is whole runs of cache rows");
    static_assert(!Config::kGathersKv || Config::kPaged, "the producer warpgroup gathers paged tiles only");
    static_assert(!kE4m3 || (kVtChunks == (kBlockN + 127) / 128 && kBlockN % 32 == 0 && !Config::kMmaRowSum &&
                                    !Config::kPaged && !Config::kVarlen),
                  "e4m3: V^T tiles are chunks of 128 keys, whole k-steps of 32; the softmax sums P in fp32");

    struct Smem {
        uint32_t q, k, v;  // shared addresses of the tiles
        uint32_t bar;      // first mbarrier

        // mbarriers, 8 bytes each: per Q stage q_full, q_empty, then per K/V stage k_full,
        // k_empty, v_full, v_empty.
        __device__ uint32_t q_full(int q) const { return bar + 8 * (2 * q); }
        __device__ uint32_t q_empty(int q) const { return bar + 8 * (2 * q + 1); }
        __device__ uint32_t stage_barrier(int s, int i) const {
            return bar + 8 * (2 * kQStages + 4 * s + i);
        }
        __device__ uint32_t k_full(int s) const { return stage_barrier(s, 0); }
        __device__ uint32_t k_empty(int s) const { return stage_barrier(s, 1); }
        __device__ uint32_t v_full(int s) const { return stage_barrier(s, 2); }
        __device__ uint32_t v_empty(int s) const { return stage_barrier(s, 3); }
        __device__ uint32_t q_tile(int q) const { return this->q + q * kQBytes; }
        __device__ uint32_t k_tile(int s) const { return k + s * kKVBytes; }
        __device__ uint32_t v_tile(int s) const { return v + s * Config::kSmemVStageBytes; }
        // kMmaRowSum: the chunk of ones after V tile s, at V's chunk stride (block_n rows of
        // 128 bytes), so that one descriptor reads V and then the ones as the next 64 columns.
        __device__ uint32_t ones_chunk(int s) const { return v_tile(s) + kVBytes; }
    };

    using Scheduler = algo::TileScheduler<Config::kMask, true>;
    using Softmax = algo::OnlineSoftmax<1, Ops, Config, Config::kMmaRowSum>;  // Config carries the softmax options

    using Work = algo::TileWork<kRowLayout>;

    static __device__ __forceinline__ Work work_for(const FagenFwdParams& prm, const Scheduler& sched,
                                                     int index) {
        return algo::tile_work<typename Config::Mask, kRowLayout>(prm, sched.tile(index), kBlockM, kBlockN);
    }

    // ---------------------------------------------------------------- producer
    // Q of a tile, once the consumers released the Q stage's previous tile (`tile_count` =
    // tiles this CTA loaded before).
    static __device__ __forceinline__ void load_q(const FagenTmaMaps& maps, const Smem& s,
                                                  const Work& w, int tile_count) {
        const int q = algo::ring_slot<kQStages>(tile_count);
        ptx::mbarrier_wait_parity(s.q_empty(q), algo::ring_parity<kQStages>(tile_count) ^ 1);
        algo::tma_load_tile<kChunks, kChunkColumns>(maps.q, s.q_tile(q), kBlockM, s.q_full(q),
                                                    w.seq().q_begin() + w.row_begin, w.head,
                                                    w.seq().tma_batch(w.batch));
    }

    // K and V of the j-th visited key block of a tile into ring position `ring` (slot
    // ring % kStages), once consumers have released the slot's previous contents.
    static __device__ __forceinline__ void load_kv(const FagenFwdParams& prm, const FagenTmaMaps& maps,
                                                   const Smem& s, const Work& w, int j, int ring) {
        const int slot = algo::ring_slot<kStages>(ring);
        const uint32_t empty_parity = algo::ring_parity<kStages>(ring) ^ 1;  // a fresh barrier passes parity 1
        const int key_begin = w.seq().k_begin() + w.n_block(j) * kBlockN;
        if constexpr (Config::kPaged) {
            const auto runs = algo::cache_runs<kBlockN, Config::kCacheBoxRows>(prm, w.batch, key_begin,
                                                                             w.seq().seqlen_k(prm));
            ptx::mbarrier_wait_parity(s.k_empty(slot), empty_parity);
            algo::tma_load_cache_tile<kChunks, kBlockN, Config::kCacheBoxRows>(maps.k, s.k_tile(slot), s.k_full(slot),
                                                                              runs, w.kv_head);
            ptx::mbarrier_wait_parity(s.v_empty(slot), empty_parity);
            algo::tma_load_cache_tile<kVChunks, kBlockN, Config::kCacheBoxRows>(maps.v, s.v_tile(slot), s.v_full(slot),
                                                                               runs, w.kv_head);
            return;
        }
        const int batch = w.seq().tma_batch(w.batch);
        ptx::mbarrier_wait_parity(s.k_empty(slot), empty_parity);
        algo::tma_load_tile<kChunks, kChunkColumns>(maps.k, s.k_tile(slot), kBlockN, s.k_full(slot), key_begin,
                                                    w.kv_head, batch);
        ptx::mbarrier_wait_parity(s.v_empty(slot), empty_parity);
        if constexpr (kE4m3) {
            algo::tma_load_transposed_tile<kHeadDimV, kVtChunks>(maps.v, s.v_tile(slot), s.v_full(slot), key_begin,
                                                                 w.kv_head, batch);
        } else {
            algo::tma_load_tile<kVChunks, kChunkColumns>(maps.v, s.v_tile(slot), kBlockN, s.v_full(slot), key_begin,
                                                         w.kv_head, batch);
        }
    }

    // Paged: whether the producer warpgroup gathers K/V (Config::kGathersKv): where TMA would
    // copy runs of the smallest box (16 keys: pages of 16, or of a size that divides no tile).
    // TMA's page-sized boxes measured faster from 32 keys on (hd128 prefill: 0.54-0.64x the
    // varlen call at 32-key pages against 0.50-0.60x gathered; 2026-12-04); else load_kv.
    static __device__ __forceinline__ bool gathers_kv(const FagenFwdParams& prm) {
        return Config::kGathersKv && prm.block_table != nullptr &&
               algo::cache_box_rows<kBlockN, Config::kCacheBoxRows>(prm) == Config::kCacheBoxRows;
    }

    // gathers_kv: K and V of the j-th visited key block into ring position `ring`, copied by the
    // producer warpgroup's 128 threads (`thread`) from the rows `rows` holds (the block's page
    // lookups), k_full and v_full counting 128 arrivals; a thread arrives once its copies
    // completed and were fenced for wgmma's (async-proxy) reads. Two latencies stay off each
    // block's path, as TMA keeps them off the dense kernels': V of position `ring` stays in
    // flight under the next position's K (the next call completes it after issuing that K,
    // finish_gathered_v the last one), and the next block's lookups go out into `rows` before
    // the wait for V's slot. Copied, completed and looked up one position at a time, the
    // prefill over 16-key pages ran at 0.33x the varlen call, with V in flight at 0.47-0.55x
    // (2026-12-04).
    //
    // No wait below can stall on the V still in flight: k_empty of position `ring` is the
    // release of K `kStages` (>= 2) positions back, which the consumers give after that block's
    // Q K^T, before they need any later V; v_empty is waited for with nothing in flight.
    static constexpr int kProducerThreads = 128;  // the producer warpgroup
    using GatherRows = algo::GatherRows<kBlockN, kProducerThreads>;

    static __device__ __forceinline__ GatherRows gather_rows(const FagenFwdParams& prm, const Work& w, int j,
                                                             int thread) {
        return GatherRows::of(prm, w.batch, w.n_block(j) * kBlockN, w.seq().seqlen_k(prm), thread);
    }

    static __device__ __forceinline__ void gather_kv(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                                     int j, int ring, int thread, GatherRows& rows) {
        static_assert(kStages >= 2);
        const int slot = algo::ring_slot<kStages>(ring);
        const uint32_t empty_parity = algo::ring_parity<kStages>(ring) ^ 1;
        const Element* k = static_cast<const Element*>(prm.k) + w.kv_head * prm.k_head_stride;
        const Element* v = static_cast<const Element*>(prm.v) + w.kv_head * prm.v_head_stride;
        ptx::mbarrier_wait_parity(s.k_empty(slot), empty_parity);
        algo::gather_cache_tile<kChunks, kBlockN, kProducerThreads>(prm, s.k_tile(slot), k, prm.k_batch_stride,
                                                                    prm.k_row_stride, rows, thread);
        if (ring > 0) {
            ptx::cp_async_wait_group<1>();  // the previous position's V; this K runs on
            ptx::fence_proxy_async_shared_cta();
            ptx::mbarrier_arrive(s.v_full(algo::ring_slot<kStages>(ring - 1)));
        }
        ptx::cp_async_wait_group<0>();
        ptx::fence_proxy_async_shared_cta();
        ptx::mbarrier_arrive(s.k_full(slot));
        const GatherRows current = rows;
        if (j + 1 < w.n_blocks) rows = gather_rows(prm, w, j + 1, thread);
        ptx::mbarrier_wait_parity(s.v_empty(slot), empty_parity);
        algo::gather_cache_tile<kVChunks, kBlockN, kProducerThreads>(prm, s.v_tile(slot), v, prm.v_batch_stride,
                                                                     prm.v_row_stride, current, thread);
    }

    // The V gather_kv left in flight at ring position `ring` (the last one).
    static __device__ __forceinline__ void finish_gathered_v(const Smem& s, int ring) {
        ptx::cp_async_wait_group<0>();
        ptx::fence_proxy_async_shared_cta();
        ptx::mbarrier_arrive(s.v_full(algo::ring_slot<kStages>(ring)));
    }

    // e4m3: the companion (<name>_vt) that writes the call's V^T before the forward runs.
    static __device__ __forceinline__ void transpose_v(const FagenFwdParams& prm, unsigned char* vt) {
        static_assert(Config::kVtKeyGroup == algo::kVtKeyGroup && Config::kVtKeysPerCta % algo::kVtKeyGroup == 0);
        algo::transpose_v_block<Config::kVtKeysPerCta, kHeadDimV, Config::kVtThreads>(prm, vt);
    }

    // ---------------------------------------------------------------- consumer MMAs
    // wgmma descriptors of a consumer's operands at k-step 0 of ring slot 0, built once: each
    // wgmma then only advances the start address (a 64-bit add), where rebuilding every field
    // cost 4 (head_dim 128) to 23 (head_dim 256) more SASS instructions per key block.
    struct Descriptors {
        unsigned long long q;  // A of Q K^T: the consumer's 64 rows of Q (K-major)
        unsigned long long k;  // B of Q K^T: K tile (K-major, N = keys)
        // B of P V: the V tile read MN-major (N = head_dim_v contiguous), or with e4m3 the V^T
        // tile read K-major (head_dim_v rows of block_n keys)
        unsigned long long v;
    };

    static __device__ __forceinline__ Descriptors descriptors(const Smem& s, int consumer, int q) {
        return {ptx::wgmma_desc_swizzle128(s.q_tile(q) + consumer * 64 * 128, 16, kSwizzleAtomBytes),
                ptx::wgmma_desc_swizzle128(s.k, 16, kSwizzleAtomBytes),
                kE4m3 ? ptx::wgmma_desc_swizzle128(s.v, 16, kSwizzleAtomBytes)
                            : ptx::wgmma_desc_swizzle128(s.v, kBlockN * 128, kSwizzleAtomBytes)};
    }

    // Q K^T for one consumer from ring slot `slot`.
    static __device__ __forceinline__ void issue_qk(float (&acc_s)[kSTiles][4], const Descriptors& d,
                                                    int slot) {
#pragma unroll
        for (int kk = 0; kk < kQKSteps; ++kk) {
            const int chunk = kk / 4;
            const uint32_t k_offset = (kk % 4) * 32;  // a k-step is 32 bytes into the row
            const unsigned long long q = ptx::wgmma_desc_advance(d.q, chunk * kBlockM * 128 + k_offset);
            const unsigned long long k = ptx::wgmma_desc_advance(d.k, slot * kKVBytes + chunk * kBlockN * 128 + k_offset);
            if constexpr (kE4m3) {
                ptx::wgmma_ss_e4m3<kBlockN>(acc_s, q, k, kk > 0);
            } else {
                ptx::wgmma_ss<kBlockN, Config::kIsBf16, 0>(acc_s, q, k, kk > 0);
            }
        }
        ptx::wgmma_commit_group();
    }

    // O += P V: A = P from registers, B = V of ring slot `slot` (and with kMmaRowSum the ones
    // after it: N = kPVColumns), with e4m3 its V^T (a k-step is 32 keys = 32 bytes into its rows).
    static __device__ __forceinline__ void issue_pv(float (&acc_o)[kOAccTiles][4],
                                                    const uint32_t (&p)[kPSteps][4],
                                                    const Descriptors& d, int slot) {
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
            if constexpr (kE4m3) {
                // k-step kk: 32 keys, in chunk kk / 4 at byte (kk % 4) * 32 of its rows
                const uint32_t offset = (kk / 4) * kHeadDimV * 128 + (kk % 4) * 32;
                ptx::wgmma_rs_e4m3<Config::kPVColumns>(
                    acc_o, p[kk], ptx::wgmma_desc_advance(d.v, slot * Config::kSmemVStageBytes + offset), 1);
            } else {
                ptx::wgmma_rs<Config::kPVColumns, Config::kIsBf16, 1>(
                    acc_o, p[kk],
                    ptx::wgmma_desc_advance(d.v, slot * Config::kSmemVStageBytes + kk * 16 * 128), 1);
            }
        }
        ptx::wgmma_commit_group();
    }

    // O *= the previous softmax's rescale factors, between issuing Q K_j^T and P_{j-1} V_{j-1}
    // (FlashAttention-3's order): the multiplies run while the tensor cores work on Q K_j^T
    // instead of in the gap between P_{j-2} V_{j-2} and the next issue. O is complete here
    // (P_{j-2} V_{j-2} was waited for) and is fenced again before P V reads it.
    static __device__ __forceinline__ void rescale_under_mma(float (&acc_o)[1][kOAccTiles][4],
                                                             const float (&rescale)[1][2]) {
        ptx::fence_accumulators(acc_o[0]);
        Softmax::rescale_output(acc_o, rescale);
        ptx::fence_accumulators(acc_o[0]);
        ptx::wgmma_fence();
    }

    // P (probabilities in the S accumulator layout) as the A fragments of P V's k-steps.
    static __device__ __forceinline__ void convert_p(const float (&acc_s)[kSTiles][4],
                                                     uint32_t (&p)[kPSteps][4]) {
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) algo::pack_a_fragment<Element>(p[kk], acc_s, kk);
    }

    // Ping-pong: a consumer waits for its turn before issuing MMAs and hands the turn to the
    // other consumer once they are issued, so one warpgroup's softmax runs under the other's
    // MMAs.
    static __device__ __forceinline__ void wait_turn(int consumer) {
        if constexpr (Config::kPingpong) ptx::bar_sync(kSchedulerBarrierBase + consumer, 256);
    }
    static __device__ __forceinline__ void pass_turn(int consumer) {
        if constexpr (Config::kPingpong) ptx::bar_arrive(kSchedulerBarrierBase + (1 - consumer), 256);
    }

    // One tile's main loop and epilogue for one consumer. `ring_base` is the ring position of
    // the tile's first key block and `tile_count` the number of tiles this CTA ran before.
    // kEarlyFirstQk: S lives in the caller's `tile_acc_s`, into which the tile's first Q K^T was
    // issued already, and `issue_next_first_qk(slot, parity, last_slot)` issues the next
    // tile's once this tile's last P V is out (S is free then: the last P is in registers); the
    // other kernels keep S to themselves and ignore both.
    template <class IssueNextFirstQk>
    static __device__ void consume(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                   int consumer, int thread, int ring_base, int tile_count,
                                   float (&tile_acc_s)[1][kSTiles][4],
                                   IssueNextFirstQk&& issue_next_first_qk) {
        const int warp = thread / 32;  // within the warpgroup
        const int lane = thread % 32;
        const int warp_row = consumer * 64 + warp * 16;  // first row of this warp in the block
        const auto mask = Config::Mask::of(prm, w.batch, w.seq().seqlen_q(prm), w.seq().seqlen_k(prm));
        const auto score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>::of(prm, w.batch, w.head,
                                                                                 w.seq().seqlen_q(prm),
                                                                                 w.seq().seqlen_k(prm));
        const int q = algo::ring_slot<kQStages>(tile_count);
        const Descriptors desc = descriptors(s, consumer, q);
        const TileScales scales = tile_scales(prm, w);
        auto slot_of = [&](int j) { return algo::ring_slot<kStages>(ring_base + j); };
        auto parity_of = [&](int j) { return algo::ring_parity<kStages>(ring_base + j); };

        float acc_o[1][kOAccTiles][4];
        algo::clear_fragment(acc_o);
        Softmax softmax;
        softmax.init();
        float own_acc_s[1][kSTiles][4];
        float(&acc_s)[1][kSTiles][4] = Config::kEarlyFirstQk ? tile_acc_s : own_acc_s;
        uint32_t p[kPSteps][4];
        float rescale[1][2];

        // No lane diverged here (the loads are the producer's), but ptxas schedules the main
        // loop around this WARPSYNC: without it and the one in `iteration`, 24 of the 32 hopper
        // kernels compile to different SASS (2026-12-01), none of it measured, so the measured
        // schedule stays.
        __syncwarp();
        // kEarlyFirstQk: waited for before the tile's first Q K^T went out.
        if constexpr (!Config::kEarlyFirstQk) {
            ptx::mbarrier_wait_parity(s.q_full(q), algo::ring_parity<kQStages>(tile_count));
        }

        // S = Q K^T of block j, masked and turned into probabilities; O is rescaled by the
        // caller once P_{j-1} V_{j-1}, still in flight here, has completed.
        auto scores = [&](int j, auto may_need_mask) {
            const int n_block = w.n_block(j);
            score.apply(acc_s, lane, w.row_begin + warp_row, n_block * kBlockN);
            if constexpr (decltype(may_need_mask)::value) {
                if (mask.block_needs_mask(n_block, w.row_begin + warp_row, 16, kBlockN)) {
                    mask.apply(acc_s, lane, w.row_begin + warp_row, n_block * kBlockN);
                }
            }
            softmax.update(acc_s, rescale, scales.scale_log2);
        };

        // Q K_j^T has completed: K_j's slot is free, and after the tile's last block so is Q,
        // whose next tile the producer then loads during the last softmax, P V and epilogue
        // instead of after them.
        auto release_k = [&](int j) {
            ptx::mbarrier_arrive(s.k_empty(slot_of(j)));
            if (j == w.n_blocks - 1) ptx::mbarrier_arrive(s.q_empty(q));
        };

        // Software pipeline: iteration j issues Q K_j and P_{j-1} V_{j-1} back to back, then runs
        // the softmax of block j while P_{j-1} V_{j-1} is still on the tensor cores.
        //
        // V_j is waited for right after the softmax that made P_j, before the wait for
        // P_{j-1} V_{j-1}. Besides being the last moment it is needed by, that wait loop ends the
        // basic block: ptxas schedules wgmma.wait_group as early as its block allows, and in the
        // same block as the softmax it went ahead of all of it (SASS of hd128 m128n160: the wait
        // right before the first row-max instruction, no exp2 under the P V), which left the
        // overlap on paper only.
        if constexpr (!Config::kEarlyFirstQk) {
            ptx::mbarrier_wait_parity(s.k_full(slot_of(0)), parity_of(0));
            wait_turn(consumer);
            ptx::wgmma_fence();
            issue_qk(acc_s[0], desc, slot_of(0));
            pass_turn(consumer);
        }
        ptx::wgmma_wait_group<0>();
        ptx::fence_accumulators(acc_s[0]);
        release_k(0);
        scores(0, BoolConstant<true>{});
        ptx::mbarrier_wait_parity(s.v_full(slot_of(0)), parity_of(0));
        if (Config::kPaged && !gathers_kv(prm)) clear_cache_rows_past_keys(prm, s, w, slot_of(0), consumer, thread);
        convert_p(acc_s[0], p);
        auto iteration = [&](int j, auto may_need_mask) {
            __syncwarp();  // see the one before the first Q K^T
            ptx::mbarrier_wait_parity(s.k_full(slot_of(j)), parity_of(j));
            wait_turn(consumer);
            ptx::wgmma_fence();
            issue_qk(acc_s[0], desc, slot_of(j));
            rescale_under_mma(acc_o, rescale);
            issue_pv(acc_o[0], p, desc, slot_of(j - 1));
            pass_turn(consumer);
            ptx::wgmma_wait_group<1>();
            ptx::fence_accumulators(acc_s[0]);
            release_k(j);
            scores(j, may_need_mask);
            ptx::mbarrier_wait_parity(s.v_full(slot_of(j)), parity_of(j));
            ptx::wgmma_wait_group<0>();
            ptx::fence_accumulators(acc_o[0]);
            ptx::mbarrier_arrive(s.v_empty(slot_of(j - 1)));
            convert_p(acc_s[0], p);
        };
        int j = 1;
        if constexpr (Config::kPeelMaskedBlocks) {
            // Iterations j < right_end and (a window) j >= left_begin may hold masked keys for
            // some row of the tile (the visited blocks run from the last key block down); each
            // warp still asks for its own rows there. The loop between them has no mask code at
            // all. Counted from the tile's first and last rows, not the warp's: a bound that
            // differs between warps made the loop counter, and with it the ring slots and phases,
            // non-uniform (run 53).
            const algo::MaskedIterations masked = mask.masked_iterations(w.key_blocks(), w.row_begin, kBlockM, kBlockN);
            for (; j < masked.right_end; ++j) iteration(j, BoolConstant<true>{});
            if constexpr (Config::Mask::kLeftEdge) {
                for (; j < masked.left_begin; ++j) iteration(j, BoolConstant<false>{});
                for (; j < w.n_blocks; ++j) iteration(j, BoolConstant<true>{});
            } else {
                for (; j < w.n_blocks; ++j) iteration(j, BoolConstant<false>{});
            }
        } else {
            for (; j < w.n_blocks; ++j) iteration(j, BoolConstant<true>{});
        }
        const int last = w.n_blocks - 1;
        rescale_under_mma(acc_o, rescale);
        issue_pv(acc_o[0], p, desc, slot_of(last));
        if constexpr (Config::kEarlyFirstQk) {
            // The next tile's first block sits right after this tile's last in the ring.
            issue_next_first_qk(slot_of(w.n_blocks), parity_of(w.n_blocks), slot_of(last));
            ptx::wgmma_wait_group<1>();  // this P V; the next Q K^T runs on
        } else {
            ptx::wgmma_wait_group<0>();
        }
        ptx::fence_accumulators(acc_o[0]);
        ptx::mbarrier_arrive(s.v_empty(slot_of(last)));

        float row_lse[1][2];
        softmax.template finalize<Config::kSinks>(acc_o, row_lse, scales.scale_log2,
                                                  Config::kSinks ? algo::head_sink_log2(prm, w.head) : 0.f,
                                                  scales.output);
        store_output(prm, w, acc_o[0], row_lse, warp_row, lane);
    }

    // Paged, TMA (a gather writes zeros there itself): each consumer zeroes the rows past the keys
    // (algo::zero_tile_rows) of the V tile of the row's last key block (the first one visited;
    // the others are whole) before its P V reads it; both write the same zeros.
    static __device__ __forceinline__ void clear_cache_rows_past_keys(const FagenFwdParams& prm, const Smem& s,
                                                                      const Work& w, int slot, int consumer,
                                                                      int thread) {
        const int valid = max(w.seq().seqlen_k(prm) - w.n_block(0) * kBlockN, 0);
        if (valid >= kBlockN) return;
        algo::zero_tile_rows<kVChunks, kBlockN, 128>(s.v_tile(slot), valid, thread);
        ptx::fence_proxy_async_shared_cta();  // the generic-proxy stores before wgmma's reads
        ptx::bar_sync(kConsumerBarrierBase + consumer, 128);
    }

    // The softmax's scale (base 2) and what O is multiplied by, for a tile's (batch, head): the
    // call's, and with e4m3 its descales folded in (FagenFwdParams.q_descale ...; null: 1).
    struct TileScales {
        float scale_log2;
        float output;
    };

    static __device__ __forceinline__ float descale(const float* values, long long batch_stride,
                                                    long long head_stride, const Work& w) {
        return algo::descale(values, batch_stride, head_stride, w.batch, w.kv_head);
    }

    static __device__ __forceinline__ TileScales tile_scales(const FagenFwdParams& prm, const Work& w) {
        if constexpr (kE4m3) {
            const float qk = descale(prm.q_descale, prm.q_descale_batch_stride, prm.q_descale_head_stride, w) *
                             descale(prm.k_descale, prm.k_descale_batch_stride, prm.k_descale_head_stride, w);
            return {prm.scale_log2 * qk,
                    descale(prm.v_descale, prm.v_descale_batch_stride, prm.v_descale_head_stride, w)};
        } else {
            return {prm.scale_log2, 1.f};
        }
    }

    // ---------------------------------------------------------------- epilogue
    // Straight from the accumulators, not staged through shared memory, which holds the next
    // tile's Q by now in a persistent kernel. In the accumulator layout a quad of lanes holds 16
    // bytes of a row per n8 tile, half a 32-byte sector; one shuffle per pair of n8 tiles gives
    // each lane 8 contiguous bytes so that a quad's stores cover whole sectors (Nsight counted
    // 50 % of the store sectors as excess before, run 25): even lanes keep their first tile's
    // pair and take the next lane's, odd lanes keep their second tile's pair and take the
    // previous lane's.
    static __device__ __forceinline__ void store_output(const FagenFwdParams& prm, const Work& w,
                                                        const float (&acc_o)[kOAccTiles][4],
                                                        const float (&row_lse)[1][2], int warp_row,
                                                        int lane) {
        static_assert(kOTiles % 2 == 0, "stores pair up n8 tiles");
        const int rows_valid = w.seq().seqlen_q(prm) - w.row_begin;
        Output* o = algo::tile_output<Output>(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin);
        const bool odd = lane & 1;
        const int quad_lane = lane & 3;
        // Column within the 16 of a tile pair: lanes 0, 2 -> 0, 4; lanes 1, 3 -> 8, 12.
        const int column = odd ? 8 + 2 * (quad_lane - 1) : 2 * quad_lane;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row + lane / 4 + 8 * h;
            Output* o_row = o + row * prm.o_row_stride;
#pragma unroll
            for (int t = 0; t < kOTiles; t += 2) {
                const uint32_t first = OutOps::pack(acc_o[t][2 * h], acc_o[t][2 * h + 1]);
                const uint32_t second = OutOps::pack(acc_o[t + 1][2 * h], acc_o[t + 1][2 * h + 1]);
                const uint32_t received = __shfl_xor_sync(0xffffffffu, odd ? first : second, 1);
                const uint2 chunk = odd ? make_uint2(received, second) : make_uint2(first, received);
                if (row < rows_valid) {
                    *reinterpret_cast<uint2*>(o_row + 8 * t + column) = chunk;
                }
            }
        }
        float* lse = algo::tile_lse(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin);
        if (lse != nullptr && lane % 4 == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row + lane / 4 + 8 * h;
                if (row < rows_valid) lse[row] = row_lse[0][h];
            }
        }
    }

    // Query rows that see no key at all (algo/mask.cuh): O = 0, LSE = -inf (with a sink: its logit).
    // Written by the kConsumerThreads consumer threads (`thread` in [0, kConsumerThreads)).
    static __device__ void write_empty_rows(const FagenFwdParams& prm, const Work& w, int thread) {
        algo::write_empty_rows<Output, kBlockM, kHeadDimV, kConsumerThreads>(
            algo::tile_output<Output>(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin), prm.o_row_stride,
            algo::tile_lse(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin), w.seq().seqlen_q(prm) - w.row_begin,
            thread,
            Config::kSinks ? prm.sinks[w.head] : algo::neg_inf());
    }

    // ---------------------------------------------------------------- entry
    static __device__ __forceinline__ Smem smem_layout(char* smem) {
        const uint32_t base = algo::swizzle_aligned_base(smem);
        return Smem{base + Config::kSmemQOffset, base + Config::kSmemKOffset,
                    base + Config::kSmemVOffset, base + Config::kSmemBarrierOffset};
    }

    static __device__ __forceinline__ Scheduler scheduler(const FagenFwdParams& prm) {
        return Scheduler::for_params(prm, kBlockM);
    }

    // `thread`: 0, or with gathers_kv each of the producer warpgroup's.
    static __device__ void produce(const FagenFwdParams& prm, const FagenTmaMaps& maps, char* smem, int thread) {
        const Smem s = smem_layout(smem);
        const Scheduler sched = scheduler(prm);
        const bool gather = gathers_kv(prm);
        int ring = 0, tile_count = 0;
        for (int index = sched.first(); index < sched.end(); index = sched.next(index)) {
            const Work w = work_for(prm, sched, index);
            if (w.n_blocks <= 0) continue;
            if (thread == 0) load_q(maps, s, w, tile_count++);  // Q is thread 0's alone
            if (gather) {
                GatherRows rows = gather_rows(prm, w, 0, thread);
                for (int j = 0; j < w.n_blocks; ++j) gather_kv(prm, s, w, j, ring++, thread, rows);
            } else {
                for (int j = 0; j < w.n_blocks; ++j) load_kv(prm, maps, s, w, j, ring++);
            }
        }
        if (gather && ring > 0) finish_gathered_v(s, ring - 1);
    }

    // `value` (the same in every lane) as a value ptxas knows to be warp-uniform: a broadcast
    // from lane 0 (CUTLASS's idiom). In the kEarlyFirstQk tile walk the consumer index derived
    // from threadIdx.x was not known to be, so the Q descriptor built from it sat in ordinary
    // registers and every wgmma moved it into uniform ones: 15 more instructions per main-loop
    // iteration (run 46). The other kernels keep the plain index: broadcast there too, it cut
    // 6-24 instructions from their main loops but measured -2...-5 % at head dims 128/256, 2k-4k
    // keys (run 47).
    static __device__ __forceinline__ int warp_uniform(int value) {
        return __shfl_sync(0xffffffffu, value, 0);
    }

    // The tile walk of kEarlyFirstQk kernels: each tile's first Q K^T goes out before the
    // previous tile's epilogue, so the next tile with keys is looked up at that point. Rows
    // without keys are written in a pass of their own afterwards, outside the loop: entry 25 of
    // docs/performance.md found that their thread-dependent store loop inside a tile walk made
    // ptxas keep the ring state in ordinary instead of uniform registers.
    static __device__ void consume_tiles_early_first_qk(const FagenFwdParams& prm, const Smem& s,
                                                        const Scheduler& sched, int consumer,
                                                        int thread) {
        auto find_tile_with_keys = [&](int& index, Work& w) {
            for (; index < sched.end(); index = sched.next(index)) {
                w = work_for(prm, sched, index);
                if (w.n_blocks > 0) return true;
            }
            return false;
        };
        float acc_s[1][kSTiles][4];
        int index = sched.first();
        Work w;
        if (find_tile_with_keys(index, w)) {
            ptx::mbarrier_wait_parity(s.q_full(0), 0);
            ptx::mbarrier_wait_parity(s.k_full(0), 0);
            ptx::wgmma_fence();
            issue_qk(acc_s[0], descriptors(s, consumer, 0), 0);
            int ring = 0, tile_count = 0;
            while (true) {
                int next_index;
                Work next;
                bool has_next;
                // Issued whether or not a next tile exists, then on this tile's last K (the
                // producer has nothing left to load over it): a wgmma issued on one path only
                // leaves ptxas unsure which accumulators are in flight after the paths join,
                // and it serializes the epilogue with an injected wait (C7517).
                auto issue_next_first_qk = [&](int slot, uint32_t parity, int last_slot) {
                    next_index = sched.next(index);
                    has_next = find_tile_with_keys(next_index, next);
                    const int q = algo::ring_slot<kQStages>(tile_count + (has_next ? 1 : 0));
                    if (has_next) {
                        ptx::mbarrier_wait_parity(s.q_full(q), algo::ring_parity<kQStages>(tile_count + 1));
                        ptx::mbarrier_wait_parity(s.k_full(slot), parity);
                    }
                    ptx::wgmma_fence();
                    issue_qk(acc_s[0], descriptors(s, consumer, q), has_next ? slot : last_slot);
                };
                consume(prm, s, w, consumer, thread, ring, tile_count, acc_s, issue_next_first_qk);
                if (!has_next) break;
                ring += w.n_blocks;
                ++tile_count;
                w = next;
                index = next_index;
            }
            ptx::wgmma_wait_group<0>();  // the Q K^T issued after the last tile
        }
        // Varlen, paged: a batch row without keys has rows without keys under any mask.
        if constexpr (Config::kMask != algo::MaskKind::kFull || kRowLayout != algo::kDenseRows) {
            for (int i = sched.first(); i < sched.end(); i = sched.next(i)) {
                const Work empty = work_for(prm, sched, i);
                if (empty.n_blocks <= 0) write_empty_rows(prm, empty, consumer * 128 + thread);
            }
        }
    }

    static __device__ void consume_tiles(const FagenFwdParams& prm, char* smem, int consumer,
                                         int thread) {
        const Smem s = smem_layout(smem);
        const Scheduler sched = scheduler(prm);
        if (Config::kPingpong && consumer == 1) pass_turn(consumer);  // consumer 0 goes first
        float unused_acc[1][kSTiles][4];
        auto no_early_qk = [](int, uint32_t, int) {};
        if constexpr (Config::kEarlyFirstQk) {
            consume_tiles_early_first_qk(prm, s, sched, warp_uniform(consumer), thread);
        } else {
            int ring = 0, tile_count = 0;
            for (int index = sched.first(); index < sched.end(); index = sched.next(index)) {
                const Work w = work_for(prm, sched, index);
                if (w.n_blocks <= 0) {
                    write_empty_rows(prm, w, consumer * 128 + thread);
                    continue;
                }
                consume(prm, s, w, consumer, thread, ring, tile_count++, unused_acc, no_early_qk);
                ring += w.n_blocks;
            }
        }
        // Balance the ping-pong barrier: consumer 1 handed out one more turn than consumer 0
        // took.
        if (Config::kPingpong && consumer == 0) ptx::bar_sync(kSchedulerBarrierBase, 256);
    }

    // kMmaRowSum: every thread writes its share of the ones chunks once, before any P V reads
    // them (through the async proxy, hence the fence).
    static __device__ __forceinline__ void fill_ones_chunks(char* smem) {
        const Smem s = smem_layout(smem);
        const uint32_t one_pair = Ops::pack(1.f, 1.f);
        constexpr int kChunkBytes = kBlockN * 128;
#pragma unroll 1
        for (int stage = 0; stage < kStages; ++stage) {
            for (int offset = 16 * threadIdx.x; offset < kChunkBytes;
                 offset += 16 * Config::kThreads) {
                *static_cast<uint4*>(__cvta_shared_to_generic(s.ones_chunk(stage) + offset)) =
                    make_uint4(one_pair, one_pair, one_pair, one_pair);
            }
        }
        ptx::fence_proxy_async_shared_cta();
    }

    // ---------------------------------------------------------------- entry
    // Each role is one branch holding its setmaxnreg, and nothing computed before the branch
    // stays live into it: ptxas then compiles each role under its own register budget.
    static __device__ void run(const FagenFwdParams& prm, const FagenTmaMaps& maps, char* smem) {
        if (threadIdx.x == 0) {
            const Smem s = smem_layout(smem);
            algo::prefetch_tma_maps(maps);
            for (int q = 0; q < kQStages; ++q) {
                ptx::mbarrier_init(s.q_full(q), 1);
                ptx::mbarrier_init(s.q_empty(q), kConsumerThreads);
            }
            const int kv_arrivals = gathers_kv(prm) ? kProducerThreads : 1;  // gather_kv's, or TMA's expect_tx
            for (int st = 0; st < kStages; ++st) {
                ptx::mbarrier_init(s.k_full(st), kv_arrivals);
                ptx::mbarrier_init(s.v_full(st), kv_arrivals);
                ptx::mbarrier_init(s.k_empty(st), kConsumerThreads);
                ptx::mbarrier_init(s.v_empty(st), kConsumerThreads);
            }
            ptx::fence_mbarrier_init_release_cluster();
        }
        if constexpr (Config::kMmaRowSum) fill_ones_chunks(smem);
        __syncthreads();

        if (threadIdx.x < 128) {
            ptx::setmaxnreg_dec<Config::kProducerRegisters>();
            if (threadIdx.x == 0 || gathers_kv(prm)) produce(prm, maps, smem, Config::kGathersKv ? threadIdx.x : 0);
        } else {
            ptx::setmaxnreg_inc<Config::kConsumerRegisters>();
            consume_tiles(prm, smem, threadIdx.x / 128 - 1, threadIdx.x % 128);
        }
    }
};

}  // namespace fagen::fa3
