// FlashAttention-4 forward on Blackwell (sm_100a): TMA loads into an mbarrier-guarded ring,
// tcgen05.mma issued by one thread with S, P and O in Tensor Memory (TMEM), softmax with one
// thread per query row, O rescaling moved to correction warps and made conditional, and an
// optional share of the exponentials computed by a polynomial on the FMA pipe.
//
// Role table (384 threads = 3 warpgroups; a warp may only touch TMEM lanes 32 * (warp % 4) ..
// + 31, so the softmax and correction warpgroups each cover all 128 rows):
//   warps 0-3  softmax      thread t owns query row t (TMEM lane t): loads S_j (tcgen05.ld),
//                           masks, updates the reference maximum, publishes the O rescale
//                           factor, writes P_j as 16-bit pairs over S_j's columns (tcgen05.st),
//                           keeps l, writes LSE.
//   warps 4-7  correction   same rows (warp % 4 matches): rescales O in TMEM between P V
//              + epilogue   steps when a row of the warp needs it, then normalizes O by 1 / l
//                           and stores it through shared memory.
//   warp 8     load         one lane issues the TMA loads of Q once and K_j, V_j per block.
//   warp 9     MMA          allocates TMEM; one lane issues S_j = Q K_j^T and O += P_{j-1}
//                           V_{j-1} and commits their completion to mbarriers.
//   warps 10-11             idle: they complete the third warpgroup, which setmaxnreg needs
//                           whole to hand its registers to the softmax warpgroup. Paged
//                           (Config::kPaged): they zero the V rows a page holds past the batch
//                           row's keys once that tile landed (clear_cache_rows_past_keys).
// Registers (setmaxnreg): the softmax warpgroup holds a whole S row per thread and gets
// Config::kSoftmaxRegisters; correction and control warpgroups give theirs up.
//
// TMEM (128 lanes = query rows): S buffer 0 at columns [0, kBlockN), S buffer 1 at [kBlockN,
// 2 kBlockN), O at [2 kBlockN, 2 kBlockN + kHeadDim). P_j overwrites the first kBlockN / 2
// columns of its own S buffer (two 16-bit values per column) and is read from there as the
// A operand of P V: P never touches shared memory. The double-buffered S lets Q K_{j+1} run on
// the tensor core while softmax works on block j.
//
// Block j (visited last key block first, so the masked blocks come first, as in FA2/FA3):
//   MMA        wait K_j            -> S_j = Q K_j^T into S[j % 2] -> commit s_full, k_empty
//              wait P_{j-1}, O ok  -> O (+)= P_{j-1} V_{j-1}       -> commit v_empty, pv_done
//   softmax    wait s_full -> max -> rescale factor to smem, arrive scale_full
//              -> exp2 -> P_j to TMEM, arrive p_full
//   correction wait scale_full, pv_done(j-1) -> rescale O if needed -> arrive o_ready
// S[j % 2] is written again by Q K_{j+2}, issued after P_j V_j by the same thread: tcgen05.mma
// runs in issue order, so that write cannot overtake the read of P_j.
//
// Shared memory (tiles 1024-byte aligned for the 128-byte swizzle): Q, kStages K tiles, kStages
// V tiles (each head_dim/64 column chunks of rows x 128 bytes, as TMA writes them), then the
// mbarriers, the TMEM address and the per-row softmax-to-correction hand-off. The epilogue
// stages O through the Q tile.
//
// e4m3 (FP8; the FA3 forward's design, fa3/forward.cuh): both products on kind::f8f6f4 (32 of K
// per instruction), the softmax scale times q's and k's descales, O times v's, P offset to reach
// 2^8 (algo/online_softmax.cuh) and stored four to a TMEM column in the key order of V^T, which
// the kernel's companion (<name>_vt) wrote into the call's workspace and P V reads K-major (as
// FA3's wgmma must); no conditional rescaling (P would pass 448); a bf16 O staged in the K ring.
#pragma once

#include "fagen/algo/descale.cuh"
#include "fagen/algo/exp2_emulation.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/online_softmax.cuh"
#include "fagen/algo/tile_output.cuh"
#include "fagen/algo/tile_scheduler.cuh"
#include "fagen/algo/tma_tile.cuh"
#include "fagen/algo/tmem_allocation.cuh"
#include "fagen/algo/v_transpose.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"
#include "fagen/ptx/bar.cuh"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/setmaxnreg.cuh"
#include "fagen/ptx/tcgen05_commit.cuh"
#include "fagen/ptx/tcgen05_fence.cuh"
#include "fagen/ptx/tcgen05_ld_st.cuh"
#include "fagen/ptx/tcgen05_mma.cuh"
#include "fagen/types.cuh"

namespace fagen::fa4 {

enum Warp : int {
    kSoftmaxWarp0 = 0,
    kCorrectionWarp0 = 4,
    kLoadWarp = 8,
    kMmaWarp = 9,
    kWarps = 12,
};

enum NamedBarrier : int {
    kEpilogueBarrier = 1,  // the four correction warps, before the coalesced O store
};

// mbarrier slots, 8 bytes each, in this order; then 4 per K/V stage.
enum Barrier : int {
    kQFull = 0,
    kSFull0 = 1,      // + buffer: S_j landed in TMEM (tcgen05.commit)
    kPFull0 = 3,      // + buffer: P_j written to TMEM (128 softmax threads)
    kScaleFull0 = 5,  // + buffer: rescale factors of block j in smem (128 softmax threads)
    kOReady = 7,      // O may take P_j V_j (128 correction threads)
    kPvDone = 8,      // P_j V_j completed (tcgen05.commit)
    kStatsFull = 9,   // final row sums in smem (128 softmax threads)
    kVCleared = 10,   // paged: the first V tile's rows past the keys zeroed (64 idle-warp threads)
};

template <class Config>
struct Forward {
    using Element = typename Config::Element;
    using Output = typename Config::Output;  // o: Element, or bf16 for e4m3
    using Ops = algo::ElementOps<Element>;

    static constexpr int kHeadDim = Config::kHeadDim;    // Q and K columns
    static constexpr int kHeadDimV = Config::kHeadDimV;  // V and O columns
    static constexpr int kBlockM = Config::kBlockM;
    static constexpr int kBlockN = Config::kBlockN;
    static constexpr int kStages = Config::kStages;
    // e4m3 (see the top of the file): both products on kind::f8f6f4, 32 of K per instruction,
    // and P V reads V^T tiles (algo/v_transpose.cuh).
    static constexpr bool kE4m3 = sizeof(Element) == 1;
    static constexpr int kChunkColumns = 128 / sizeof(Element);  // of a 128-byte swizzle row
    static constexpr int kChunks = kHeadDim / kChunkColumns;     // column chunks of a Q or K tile
    static constexpr int kVChunks = kHeadDimV / kChunkColumns;   // and of a V tile
    static constexpr int kVtChunks = kBlockN / 128;              // 128-key chunks of a V^T tile
    static constexpr int kStepK = 32 / sizeof(Element);          // K of one MMA: 32 bytes of a row
    static constexpr int kQKSteps = kHeadDim / kStepK;
    static constexpr int kPVSteps = kBlockN / kStepK;
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);  // a K tile
    static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);  // a V (V^T) tile
    static constexpr uint32_t kSwizzleAtomBytes = algo::kSwizzleAtomBytes;
    static constexpr uint32_t kOColumn = 2 * kBlockN;
    static constexpr uint32_t kQKInstr =
        kE4m3 ? ptx::Tcgen05E4m3InstructionDescriptor<kBlockM, kBlockN, false>::value
              : ptx::Tcgen05F16InstructionDescriptor<kBlockM, kBlockN, Config::kIsBf16, false>::value;
    static constexpr uint32_t kPVInstr =
        kE4m3 ? ptx::Tcgen05E4m3InstructionDescriptor<kBlockM, kHeadDimV, false>::value
              : ptx::Tcgen05F16InstructionDescriptor<kBlockM, kHeadDimV, Config::kIsBf16, true>::value;
    // The epilogue stages O (Output) in the Q tile, or with e4m3 (a 1-byte Q tile, a 2-byte O)
    // in the K ring, free once the last P V has completed.
    static constexpr uint32_t kOBytes = kBlockM * kHeadDimV * sizeof(Output);

    static_assert(kBlockM == 128, "one M = 128 MMA: TMEM lane = query row = softmax thread");
    static_assert(Config::kThreads == 32 * kWarps);
    static_assert(kHeadDim % kChunkColumns == 0 && kHeadDimV % kChunkColumns == 0 && kHeadDimV <= 256,
                  "TMA boxes are one 128-byte row; MMA N <= 256");
    static_assert(kBlockN % 32 == 0 && kBlockN <= 256, "P is stored 32 columns at a time");
    static_assert(!kE4m3 || (kBlockN % 128 == 0 && !Config::kConditionalRescale),
                  "e4m3: V^T tiles are chunks of 128 keys; P, offset to reach 256, would pass e4m3's 448 "
                  "under a lagging reference");
    static_assert(kOBytes <= (kE4m3 ? kStages * kKVBytes : kQBytes), "O's staging");
    static_assert(kOColumn + kHeadDimV <= Config::kTmemColumns && Config::kTmemColumns <= 512);
    static_assert((Config::kTmemColumns & (Config::kTmemColumns - 1)) == 0 &&
                  Config::kTmemColumns >= 32, "tcgen05.alloc takes a power of two >= 32");
    static_assert(Config::kSmemKOffset == Config::kSmemQOffset + kQBytes);
    static_assert(Config::kSmemVOffset == Config::kSmemKOffset + kStages * kKVBytes);
    static_assert(Config::kSmemBarrierOffset == Config::kSmemVOffset + kStages * kVBytes);
    static_assert(Config::kSmemQOffset % kSwizzleAtomBytes == 0 &&
                  Config::kSmemKOffset % kSwizzleAtomBytes == 0 &&
                  Config::kSmemVOffset % kSwizzleAtomBytes == 0);

    struct Smem {
        uint32_t q, k, v, bar;

        __device__ uint32_t barrier(int index) const { return bar + 8 * index; }
        __device__ uint32_t k_full(int s) const { return barrier(Config::kFixedBarriers + 4 * s); }
        __device__ uint32_t k_empty(int s) const { return barrier(Config::kFixedBarriers + 4 * s + 1); }
        __device__ uint32_t v_full(int s) const { return barrier(Config::kFixedBarriers + 4 * s + 2); }
        __device__ uint32_t v_empty(int s) const { return barrier(Config::kFixedBarriers + 4 * s + 3); }
        __device__ uint32_t k_tile(int s) const { return k + s * kKVBytes; }
        __device__ uint32_t v_tile(int s) const { return v + s * kVBytes; }
        __device__ uint32_t tmem_slot() const { return barrier(Config::kFixedBarriers + 4 * kStages); }
        // Per-row floats: rescale factors of the two blocks in flight, then final row sums.
        __device__ uint32_t row_scale(int buffer) const { return tmem_slot() + 16 + buffer * kBlockM * 4; }
        __device__ uint32_t row_sum() const { return row_scale(2); }
    };
    static_assert(Config::kSmemControlBytes == 8 * (Config::kFixedBarriers + 4 * kStages) + 16 + 3 * kBlockM * 4);

    // Dense, varlen (Config::kVarlen: algo/batch_row.cuh; the maps span the packed rows, batch 1)
    // or paged (Config::kPaged: a KV cache's keys through the block table, fagen/runtime/kvcache.py).
    static constexpr int kRowLayout = Config::kPaged ? algo::kPagedRows : Config::kVarlen ? algo::kVarlenRows
                                                                                           : algo::kDenseRows;
    static_assert(!Config::kPaged || (!Config::kVarlen && !kE4m3 && kBlockN % Config::kCacheBoxRows == 0),
                  "a paged K/V tile is whole runs of 16-bit cache rows");
    static_assert(Config::kFixedBarriers == kVCleared + (Config::kPaged ? 1 : 0), "fagen/model/fa4.py: fixed_mbarriers");
    using Work = algo::TileWork<kRowLayout>;

    static __device__ __forceinline__ float load_shared_f32(uint32_t addr) {
        return *static_cast<const float*>(__cvta_shared_to_generic(addr));
    }
    static __device__ __forceinline__ void store_shared_f32(uint32_t addr, float value) {
        *static_cast<float*>(__cvta_shared_to_generic(addr)) = value;
    }

    // ---------------------------------------------------------------- load warp
    static __device__ void load(const FagenFwdParams& prm, const FagenTmaMaps& maps, const Smem& s, const Work& w) {
        const int batch = w.seq().tma_batch(w.batch);
        algo::tma_load_tile<kChunks, kChunkColumns>(maps.q, s.q, kBlockM, s.barrier(kQFull),
                                                    w.seq().q_begin() + w.row_begin, w.head, batch);
        for (int j = 0; j < w.n_blocks; ++j) {
            const int slot = j % kStages;
            const uint32_t empty_parity = ((j / kStages) & 1) ^ 1;  // a fresh barrier passes parity 1
            const int key_begin = w.seq().k_begin() + w.n_block(j) * kBlockN;
            if constexpr (Config::kPaged) {
                const auto runs = algo::cache_runs<kBlockN, Config::kCacheBoxRows>(prm, w.batch, key_begin,
                                                                                 w.seq().seqlen_k(prm));
                ptx::mbarrier_wait_parity(s.k_empty(slot), empty_parity);
                algo::tma_load_cache_tile<kChunks, kBlockN, Config::kCacheBoxRows>(maps.k, s.k_tile(slot),
                                                                                  s.k_full(slot), runs, w.kv_head);
                ptx::mbarrier_wait_parity(s.v_empty(slot), empty_parity);
                algo::tma_load_cache_tile<kVChunks, kBlockN, Config::kCacheBoxRows>(maps.v, s.v_tile(slot),
                                                                                   s.v_full(slot), runs, w.kv_head);
                continue;
            }
            ptx::mbarrier_wait_parity(s.k_empty(slot), empty_parity);
            algo::tma_load_tile<kChunks, kChunkColumns>(maps.k, s.k_tile(slot), kBlockN, s.k_full(slot),
                                         key_begin, w.kv_head, batch);
            ptx::mbarrier_wait_parity(s.v_empty(slot), empty_parity);
            if constexpr (kE4m3) {  // V^T (dense only): its rows are the head dim, the keys its columns
                algo::tma_load_transposed_tile<kHeadDimV, kVtChunks>(maps.v, s.v_tile(slot), s.v_full(slot), key_begin,
                                                                     w.kv_head, batch);
            } else {
                algo::tma_load_tile<kVChunks>(maps.v, s.v_tile(slot), kBlockN, s.v_full(slot),
                                             key_begin, w.kv_head, batch);
            }
        }
    }

    // Paged: the idle warps' 64 threads zero the rows past the keys (algo::zero_tile_rows) of the
    // first visited V tile (the row's last key block; the others are whole) once it landed, and
    // P_0 V_0 waits for them.
    static constexpr int kClearThreads = 64;

    static __device__ void clear_cache_rows_past_keys(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                                      int thread) {
        ptx::mbarrier_wait_parity(s.v_full(0), 0);
        const int valid = max(w.seq().seqlen_k(prm) - w.n_block(0) * kBlockN, 0);
        if (valid < kBlockN) algo::zero_tile_rows<kVChunks, kBlockN, kClearThreads>(s.v_tile(0), valid, thread);
        ptx::fence_proxy_async_shared_cta();  // the generic-proxy stores before tcgen05.mma's reads
        ptx::mbarrier_arrive(s.barrier(kVCleared));
    }

    // ---------------------------------------------------------------- MMA thread
    // One MMA of the element's kind (kind::f16, or kind::f8f6f4 for e4m3).
    static __device__ __forceinline__ void mma_ss(uint32_t tmem_d, unsigned long long a, unsigned long long b,
                                                  uint32_t instr, bool accumulate) {
        if constexpr (kE4m3) {
            ptx::tcgen05_mma_f8f6f4_ss(tmem_d, a, b, instr, accumulate);
        } else {
            ptx::tcgen05_mma_f16_ss(tmem_d, a, b, instr, accumulate);
        }
    }

    // S[buffer] = Q K^T: A = Q (K-major), B = K tile (K-major, N = keys); 32 bytes of a swizzled
    // 128-byte row (16 columns, or 32 of e4m3) per instruction.
    static __device__ __forceinline__ void issue_qk(const Smem& s, uint32_t tmem, int slot,
                                                    int buffer) {
#pragma unroll
        for (int kk = 0; kk < kQKSteps; ++kk) {
            const uint32_t k_offset = (kk % 4) * 32;
            const unsigned long long desc_q = ptx::tcgen05_smem_desc_swizzle128(
                s.q + (kk / 4) * kBlockM * 128 + k_offset, 16, kSwizzleAtomBytes);
            const unsigned long long desc_k = ptx::tcgen05_smem_desc_swizzle128(
                s.k_tile(slot) + (kk / 4) * kBlockN * 128 + k_offset, 16, kSwizzleAtomBytes);
            mma_ss(tmem + buffer * kBlockN, desc_q, desc_k, kQKInstr, kk > 0);
        }
    }

    // O (+)= P V: A = P from TMEM (8 columns = 16 keys per step, or 32 of e4m3), B = the V tile
    // read MN-major (head_dim_v contiguous; consecutive 64-column chunks kBlockN * 128 bytes
    // apart), or with e4m3 the V^T tile read K-major (head_dim_v rows of 128 keys per chunk).
    static __device__ __forceinline__ void issue_pv(const Smem& s, uint32_t tmem, int slot,
                                                    int buffer, bool accumulate) {
#pragma unroll
        for (int kk = 0; kk < kPVSteps; ++kk) {
            if constexpr (kE4m3) {
                const unsigned long long desc_vt = ptx::tcgen05_smem_desc_swizzle128(
                    s.v_tile(slot) + (kk / 4) * kHeadDimV * 128 + (kk % 4) * 32, 16, kSwizzleAtomBytes);
                ptx::tcgen05_mma_f8f6f4_ts(tmem + kOColumn, tmem + buffer * kBlockN + kk * 8, desc_vt,
                                           kPVInstr, accumulate || kk > 0);
            } else {
                const unsigned long long desc_v = ptx::tcgen05_smem_desc_swizzle128(
                    s.v_tile(slot) + kk * 16 * 128, kBlockN * 128, kSwizzleAtomBytes);
                ptx::tcgen05_mma_f16_ts(tmem + kOColumn, tmem + buffer * kBlockN + kk * 8, desc_v,
                                        kPVInstr, accumulate || kk > 0);
            }
        }
    }

    static __device__ void mma(const Smem& s, const Work& w, uint32_t tmem) {
        ptx::mbarrier_wait_parity(s.barrier(kQFull), 0);
        // P V of block j - 1 once its P is in TMEM and the correction warps are done with O.
        auto pv_step = [&](int j) {
            const int slot = j % kStages;
            ptx::mbarrier_wait_parity(s.barrier(kPFull0 + (j & 1)), (j >> 1) & 1);
            ptx::mbarrier_wait_parity(s.barrier(kOReady), j & 1);
            ptx::mbarrier_wait_parity(s.v_full(slot), (j / kStages) & 1);
            if (Config::kPaged && j == 0) ptx::mbarrier_wait_parity(s.barrier(kVCleared), 0);
            ptx::tcgen05_fence_after_thread_sync();
            issue_pv(s, tmem, slot, j & 1, j > 0);
            ptx::tcgen05_commit(s.v_empty(slot));
            ptx::tcgen05_commit(s.barrier(kPvDone));
        };
        for (int j = 0; j < w.n_blocks; ++j) {
            const int slot = j % kStages;
            ptx::mbarrier_wait_parity(s.k_full(slot), (j / kStages) & 1);
            ptx::tcgen05_fence_after_thread_sync();
            issue_qk(s, tmem, slot, j & 1);
            ptx::tcgen05_commit(s.barrier(kSFull0 + (j & 1)));
            ptx::tcgen05_commit(s.k_empty(slot));
            if (j > 0) pv_step(j - 1);
        }
        pv_step(w.n_blocks - 1);
    }

    // ---------------------------------------------------------------- softmax warps
    // The softmax's scale (base 2) and what O is multiplied by, for a tile's (batch, head): the
    // call's, and with e4m3 its descales folded in (FagenFwdParams.q_descale ...; null: 1).
    struct TileScales {
        float scale_log2;
        float output;
    };

    static __device__ __forceinline__ TileScales tile_scales(const FagenFwdParams& prm, const Work& w) {
        if constexpr (kE4m3) {
            const float q = algo::descale(prm.q_descale, prm.q_descale_batch_stride, prm.q_descale_head_stride,
                                          w.batch, w.kv_head);
            const float k = algo::descale(prm.k_descale, prm.k_descale_batch_stride, prm.k_descale_head_stride,
                                          w.batch, w.kv_head);
            return {prm.scale_log2 * q * k, algo::descale(prm.v_descale, prm.v_descale_batch_stride,
                                                          prm.v_descale_head_stride, w.batch, w.kv_head)};
        } else {
            return {prm.scale_log2, 1.f};
        }
    }

    // e4m3: the row's probabilities of a block (scores in, exponents taken in place) into TMEM
    // four to a column, in V^T's key order (algo/v_transpose.cuh: the column 4q + i of each 16
    // keys holds key {2q, 2q + 1, 8 + 2q, 9 + 2q}[i]); `sum` adds them unrounded.
    static __device__ __forceinline__ void store_e4m3_probabilities(float (&scores)[kBlockN], uint32_t tmem_s,
                                                                    float scale_log2, float subtrahend, float& sum) {
#pragma unroll
        for (int c = 0; c < kBlockN; ++c) {
            scores[c] = algo::softmax_exp2<Config::kExp2EmulationPeriod>(c / 2, fmaf(scores[c], scale_log2, -subtrahend));
            sum += scores[c];
        }
#pragma unroll
        for (int chunk = 0; chunk < kBlockN / 64; ++chunk) {
            uint32_t packed[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int base = 64 * chunk + 16 * (i / 4), q = i % 4;
                packed[i] = Ops::pack(scores[base + 2 * q], scores[base + 2 * q + 1], scores[base + 8 + 2 * q],
                                      scores[base + 9 + 2 * q]);
            }
            ptx::tcgen05_st_32x32b_x16(tmem_s + chunk * 16, packed);
        }
    }

    static __device__ void softmax(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                   uint32_t tmem, int row) {
        const uint32_t tmem_row = tmem + (static_cast<uint32_t>(row & ~31) << 16);
        using Mask = algo::AttentionMask<Config::kMask>;
        const Mask mask = Mask::of(prm, w.batch, w.seq().seqlen_q(prm), w.seq().seqlen_k(prm));
        // The keys [key_begin, key_end) this row sees (a window's left edge, the right edge).
        const int key_begin = mask.key_begin(w.row_begin + row);
        const int key_end = mask.key_end(w.row_begin + row);
        const auto score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>::of(prm, w.batch, w.head, mask.seqlen_q,
                                                                                mask.seqlen_k);
        const float scale_log2 = tile_scales(prm, w).scale_log2;
        float reference = algo::neg_inf();
        float row_sum = 0.f;
        float row_rounding = 0.f;  // round16(P) - P of each block's largest P (algo/online_softmax.cuh)

        for (int j = 0; j < w.n_blocks; ++j) {
            const int buffer = j & 1;
            const uint32_t tmem_s = tmem_row + buffer * kBlockN;
            ptx::mbarrier_wait_parity(s.barrier(kSFull0 + buffer), (j >> 1) & 1);
            ptx::tcgen05_fence_after_thread_sync();
            uint32_t raw[kBlockN / 16][16];
#pragma unroll
            for (int c = 0; c < kBlockN / 16; ++c) ptx::tcgen05_ld_32x32b_x16(tmem_s + c * 16, raw[c]);
            ptx::tcgen05_wait_ld();
            float scores[kBlockN];
#pragma unroll
            for (int c = 0; c < kBlockN / 16; ++c) {
                ptx::tcgen05_ld_fence_registers(raw[c]);
#pragma unroll
                for (int i = 0; i < 16; ++i) scores[c * 16 + i] = __uint_as_float(raw[c][i]);
            }

            const int n_block = w.n_block(j);
            if constexpr (!decltype(score)::kIdentity) {
#pragma unroll
                for (int c = 0; c < kBlockN; ++c) scores[c] = score.modify(scores[c], w.row_begin + row, n_block * kBlockN + c);
            }
            if (mask.block_needs_mask(n_block, w.row_begin, kBlockM, kBlockN)) {
#pragma unroll
                for (int c = 0; c < kBlockN; ++c) {
                    const int key = n_block * kBlockN + c;
                    if (key >= key_end || (Mask::kLeftEdge && key < key_begin)) scores[c] = algo::neg_inf();
                }
            }
            float own_max = algo::neg_inf();
#pragma unroll
            for (int c = 0; c < kBlockN; ++c) own_max = fmaxf(own_max, scores[c]);
            const algo::ReferenceMax next = algo::next_reference_max<Config::kConditionalRescale>(
                reference, fmaxf(reference, own_max), scale_log2, Config::kRescaleThreshold);
            store_shared_f32(s.row_scale(buffer) + row * 4, next.rescale);
            ptx::mbarrier_arrive(s.barrier(kScaleFull0 + buffer));
            reference = next.value;
            // e4m3: P taken up to 2^offset (algo/online_softmax.cuh: kProbabilityLog2Offset).
            const float subtrahend = algo::reference_scaled(reference, scale_log2) - Ops::kProbabilityLog2Offset;

            float sum = 0.f;
            if constexpr (kE4m3) {
                store_e4m3_probabilities(scores, tmem_s, scale_log2, subtrahend, sum);
            } else {
#pragma unroll
                for (int c = 0; c < kBlockN / 32; ++c) {
                    uint32_t packed[16];
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        const int pair = c * 16 + i;
                        const float p0 = algo::softmax_exp2<Config::kExp2EmulationPeriod>(
                            pair, fmaf(scores[2 * pair], scale_log2, -subtrahend));
                        const float p1 = algo::softmax_exp2<Config::kExp2EmulationPeriod>(
                            pair, fmaf(scores[2 * pair + 1], scale_log2, -subtrahend));
                        sum += p0 + p1;
                        packed[i] = Ops::pack(p0, p1);
                    }
                    ptx::tcgen05_st_32x32b_x16(tmem_s + c * 16, packed);
                }
            }
            row_sum = row_sum * next.rescale + sum;
            row_rounding = row_rounding * next.rescale + algo::operand_rounding<Ops>(own_max, scale_log2, subtrahend);
            ptx::tcgen05_wait_st();
            ptx::tcgen05_fence_before_thread_sync();
            ptx::mbarrier_arrive(s.barrier(kPFull0 + buffer));
        }

        // What O is divided by; with a sink also its term against the keys' reference (O / (l +
        // 2^(sink - m2)) = O keys / (l keys + sink), algo::sink_term; inf where the sink takes
        // the whole row: O = 0).
        float divisor = row_sum + row_rounding;
        float row_lse = algo::natural_lse(algo::reference_scaled(reference, scale_log2) - Ops::kProbabilityLog2Offset,
                                          row_sum);
        if constexpr (Config::kSinks) {
            static_assert(!kE4m3, "fagen/model/fa4.py: e4m3 kernels take no score modifier");
            const float sink_log2 = algo::head_sink_log2(prm, w.head);
            const float keys_top = algo::reference_scaled(reference, scale_log2);
            const algo::SinkTerm t = algo::sink_term(row_sum, keys_top, sink_log2);
            divisor += ptx::ex2_approx_ftz(sink_log2 - keys_top);
            row_lse = algo::natural_lse(t.top, fmaf(row_sum, t.keys, t.sink));
        }
        store_shared_f32(s.row_sum() + row * 4, divisor);
        ptx::mbarrier_arrive(s.barrier(kStatsFull));
        const int rows_valid = mask.seqlen_q - w.row_begin;
        float* lse = algo::tile_lse(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin);
        if (lse != nullptr && row < rows_valid) lse[row] = row_lse;
    }

    // ---------------------------------------------------------------- correction warps
    static __device__ void correct(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                   uint32_t tmem, int row) {
        const uint32_t tmem_o = tmem + (static_cast<uint32_t>(row & ~31) << 16) + kOColumn;
        for (int j = 0; j < w.n_blocks; ++j) {
            const int buffer = j & 1;
            ptx::mbarrier_wait_parity(s.barrier(kScaleFull0 + buffer), (j >> 1) & 1);
            const float scale = load_shared_f32(s.row_scale(buffer) + row * 4);
            if (j > 0) {
                // O holds blocks 0..j-1 only once P_{j-1} V_{j-1} has completed.
                ptx::mbarrier_wait_parity(s.barrier(kPvDone), (j - 1) & 1);
                if (__any_sync(0xffffffffu, scale != 1.f)) {
                    ptx::tcgen05_fence_after_thread_sync();
#pragma unroll
                    for (int c = 0; c < kHeadDimV / 16; ++c) {
                        uint32_t o[16];
                        ptx::tcgen05_ld_32x32b_x16(tmem_o + c * 16, o);
                        ptx::tcgen05_wait_ld();
                        ptx::tcgen05_ld_fence_registers(o);
#pragma unroll
                        for (int i = 0; i < 16; ++i) o[i] = __float_as_uint(__uint_as_float(o[i]) * scale);
                        ptx::tcgen05_st_32x32b_x16(tmem_o + c * 16, o);
                    }
                    ptx::tcgen05_wait_st();
                }
            }
            ptx::tcgen05_fence_before_thread_sync();
            ptx::mbarrier_arrive(s.barrier(kOReady));
        }
        ptx::mbarrier_wait_parity(s.barrier(kPvDone), (w.n_blocks - 1) & 1);
        ptx::mbarrier_wait_parity(s.barrier(kStatsFull), 0);
        ptx::tcgen05_fence_after_thread_sync();
        const float sum = load_shared_f32(s.row_sum() + row * 4);
        store_output(prm, s, w, tmem_o, algo::inverse_row_sum(sum) * tile_scales(prm, w).output, row);
    }

    // ---------------------------------------------------------------- epilogue
    // Every MMA has completed (the last P V was waited on), so the Q tile (e4m3: the K ring) is
    // free: O goes there in the swizzled layout TMA used for Q (each thread writes its row's
    // 16-byte units to distinct bank groups), then out as coalesced 16-byte vectors, row-bounded.
    static __device__ __forceinline__ uint32_t swizzled_offset(int row, int col) {
        const int chunk = col / 64;
        const int byte_in_row = (col % 64) * 2;
        const int unit = (byte_in_row / 16) ^ (row % 8);
        return chunk * kBlockM * 128 + row * 128 + unit * 16 + byte_in_row % 16;
    }

    static __device__ void store_output(const FagenFwdParams& prm, const Smem& s, const Work& w,
                                        uint32_t tmem_o, float inv, int row) {
        using OutOps = algo::ElementOps<Output>;
        char* smem_generic = static_cast<char*>(__cvta_shared_to_generic(kE4m3 ? s.k : s.q));
#pragma unroll
        for (int c = 0; c < kHeadDimV / 16; ++c) {
            uint32_t o[16];
            ptx::tcgen05_ld_32x32b_x16(tmem_o + c * 16, o);
            ptx::tcgen05_wait_ld();
            ptx::tcgen05_ld_fence_registers(o);
            uint4 lo, hi;
            lo.x = OutOps::pack(__uint_as_float(o[0]) * inv, __uint_as_float(o[1]) * inv);
            lo.y = OutOps::pack(__uint_as_float(o[2]) * inv, __uint_as_float(o[3]) * inv);
            lo.z = OutOps::pack(__uint_as_float(o[4]) * inv, __uint_as_float(o[5]) * inv);
            lo.w = OutOps::pack(__uint_as_float(o[6]) * inv, __uint_as_float(o[7]) * inv);
            hi.x = OutOps::pack(__uint_as_float(o[8]) * inv, __uint_as_float(o[9]) * inv);
            hi.y = OutOps::pack(__uint_as_float(o[10]) * inv, __uint_as_float(o[11]) * inv);
            hi.z = OutOps::pack(__uint_as_float(o[12]) * inv, __uint_as_float(o[13]) * inv);
            hi.w = OutOps::pack(__uint_as_float(o[14]) * inv, __uint_as_float(o[15]) * inv);
            *reinterpret_cast<uint4*>(smem_generic + swizzled_offset(row, c * 16)) = lo;
            *reinterpret_cast<uint4*>(smem_generic + swizzled_offset(row, c * 16 + 8)) = hi;
        }
        ptx::bar_sync(kEpilogueBarrier, kBlockM);
        const int rows_valid = w.seq().seqlen_q(prm) - w.row_begin;
        Output* out = algo::tile_output<Output>(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin);
        constexpr int kVecsPerRow = kHeadDimV / 8;
        for (int idx = row; idx < kBlockM * kVecsPerRow; idx += kBlockM) {
            const int r = idx / kVecsPerRow;
            const int col = (idx % kVecsPerRow) * 8;
            if (r < rows_valid) {
                *reinterpret_cast<uint4*>(out + r * prm.o_row_stride + col) =
                    *reinterpret_cast<const uint4*>(smem_generic + swizzled_offset(r, col));
            }
        }
    }

    // Rows that see no key (algo::write_empty_rows), written by the whole CTA.
    static __device__ void write_empty_rows(const FagenFwdParams& prm, const Work& w) {
        algo::write_empty_rows<Output, kBlockM, kHeadDimV, Config::kThreads>(
            algo::tile_output<Output>(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin), prm.o_row_stride,
            algo::tile_lse(prm, w.batch, w.head, w.seq().q_begin() + w.row_begin), w.seq().seqlen_q(prm) - w.row_begin,
            threadIdx.x, Config::kSinks ? prm.sinks[w.head] : algo::neg_inf());
    }

    // e4m3: the companion (<name>_vt) that writes the call's V^T before the forward runs.
    static __device__ __forceinline__ void transpose_v(const FagenFwdParams& prm, unsigned char* vt) {
        static_assert(Config::kVtKeyGroup == algo::kVtKeyGroup && Config::kVtKeysPerCta % algo::kVtKeyGroup == 0);
        algo::transpose_v_block<Config::kVtKeysPerCta, kHeadDimV, Config::kVtThreads>(prm, vt);
    }

    // ---------------------------------------------------------------- entry
    // The CTA's tile, which each role computes after its setmaxnreg (and the CTA again at the end,
    // for rows that see no key) rather than the entry's being kept across it: values of a tile
    // live across setmaxnreg spilled (4-8 bytes, under windows, varlen, head dim 256; 2026-12-04).
    static __device__ __forceinline__ Work work_of_cta(const FagenFwdParams& prm) {
        const auto sched = algo::TileScheduler<Config::kMask, false>::for_params(prm, kBlockM);
        return algo::tile_work<algo::AttentionMask<Config::kMask>, kRowLayout>(prm, sched.tile(sched.first()), kBlockM,
                                                                              kBlockN);
    }

    static __device__ void run(const FagenFwdParams& prm, const FagenTmaMaps& maps, char* smem) {
        const uint32_t base = algo::swizzle_aligned_base(smem);
        const Smem s{base + Config::kSmemQOffset, base + Config::kSmemKOffset,
                     base + Config::kSmemVOffset, base + Config::kSmemBarrierOffset};
        const int warp = threadIdx.x / 32;

        if (threadIdx.x == 0) {
            algo::prefetch_tma_maps(maps);
            ptx::mbarrier_init(s.barrier(kQFull), 1);
            for (int b = 0; b < 2; ++b) {
                ptx::mbarrier_init(s.barrier(kSFull0 + b), 1);
                ptx::mbarrier_init(s.barrier(kPFull0 + b), kBlockM);
                ptx::mbarrier_init(s.barrier(kScaleFull0 + b), kBlockM);
            }
            ptx::mbarrier_init(s.barrier(kOReady), kBlockM);
            ptx::mbarrier_init(s.barrier(kPvDone), 1);
            ptx::mbarrier_init(s.barrier(kStatsFull), kBlockM);
            if constexpr (Config::kPaged) ptx::mbarrier_init(s.barrier(kVCleared), kClearThreads);
            for (int st = 0; st < kStages; ++st) {
                ptx::mbarrier_init(s.k_full(st), 1);
                ptx::mbarrier_init(s.k_empty(st), 1);
                ptx::mbarrier_init(s.v_full(st), 1);
                ptx::mbarrier_init(s.v_empty(st), 1);
            }
            ptx::fence_mbarrier_init_release_cluster();
        }
        algo::allocate_tmem<Config::kTmemColumns>(s.tmem_slot(), warp == kMmaWarp);

        // Each role reads the TMEM base and computes its tile after its setmaxnreg: values kept
        // across it spilled (the tile: varlen, 2026-12-04; the base: paged, 2026-12-05).
        if (warp < kCorrectionWarp0) {
            ptx::setmaxnreg_inc<Config::kSoftmaxRegisters>();
            const Work w = work_of_cta(prm);
            if (w.n_blocks > 0) softmax(prm, s, w, algo::tmem_base(s.tmem_slot()), threadIdx.x - kSoftmaxWarp0 * 32);
        } else if (warp < kLoadWarp) {
            ptx::setmaxnreg_dec<Config::kCorrectionRegisters>();
            const Work w = work_of_cta(prm);
            if (w.n_blocks > 0) correct(prm, s, w, algo::tmem_base(s.tmem_slot()), threadIdx.x - kCorrectionWarp0 * 32);
        } else {
            ptx::setmaxnreg_dec<Config::kControlRegisters>();
            const Work w = work_of_cta(prm);
            if (w.n_blocks > 0 && threadIdx.x == kLoadWarp * 32) load(prm, maps, s, w);
            if (w.n_blocks > 0 && threadIdx.x == kMmaWarp * 32) mma(s, w, algo::tmem_base(s.tmem_slot()));
            if (Config::kPaged && w.n_blocks > 0 && threadIdx.x >= (kMmaWarp + 1) * 32) {
                clear_cache_rows_past_keys(prm, s, w, threadIdx.x - (kMmaWarp + 1) * 32);
            }
        }
        __syncwarp();

        algo::release_tmem<Config::kTmemColumns>(algo::tmem_base(s.tmem_slot()), threadIdx.x / 32 == kMmaWarp);
        const Work w = work_of_cta(prm);
        if (w.n_blocks <= 0) write_empty_rows(prm, w);  // the roles did nothing
    }
};

}  // namespace fagen::fa4
