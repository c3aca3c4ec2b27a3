// FlashAttention-4 backward on Blackwell (sm_100a): the FA2 / FA3 backward's recomputation (a key
// block's dK and dV accumulate while it walks the query blocks) with every product a tcgen05.mma
// issued by one thread, S^T, dP^T, dV, dK and dQ in Tensor Memory (TMEM), and the element-wise
// work done by warps with one thread per TMEM lane, as in the FA4 forward (fa4/forward.cuh).
//
// Three kernels of one cubin (fagen/contract.py, "Backward kernels"): the row kernels of
// algo/backward_rows.cuh before and after this file's main kernel.
//
// One CTA per tile (key block of kBlockN = 128 keys, K/V head, batch), which walks the query
// blocks of kBlockM rows of every query head its K/V head serves (algo::BackwardWalk): 128, or 64
// at head dims 192 / 128 (TMEM holds no more) and with the softcap (registers; fa4_bwd.py).
// Dense or varlen (Config::kVarlen: algo/batch_row.cuh; the maps span the packed rows, batch 1).
// Role table (384 threads = 3 warpgroups; a warp touches the TMEM lanes 32 * (warp % 4) .. + 31):
//   warps 0-3  compute  thread t owns key t (TMEM lane t of S^T, dP^T): per step P^T = exp2(S^T
//                       scale_log2 - LSE) over S^T's columns, then dS^T = P^T (dP^T - D) over
//                       dP^T's columns and into shared memory (dQ's operand), masks, ALiBi and the
//                       softcap (its 1 - u^2 kept per score: steps of 64 queries) per element.
//   warps 4-7  dQ       thread t owns TMEM lane t of dQ_i: query t of the step (red.v4 of its
//              + dK dV  row), or in 64-query steps (Config::kDqTransposed) a head-dim column of each
//                       dQ_i^T product (a red per query); it loads dQ_i, frees its columns and
//                       adds it to the fp32 accumulator in global memory (in deterministic mode
//                       in key-block order); at the end thread t writes key t's rows of dK (times
//                       softmax_scale) and dV.
//   warp 8     load     one lane issues the TMA loads: K and V once, Q_i and dO_i per step into
//                       a ring of kStages.
//   warp 9     MMA      allocates TMEM; one lane issues the five products of each step.
//   warps 10-11         idle: they complete the third warpgroup for setmaxnreg.
//
// TMEM (128 lanes; fp32 columns): S^T [0, kBlockM) with P^T over its first kBlockM / 2 columns
// (two 16-bit values per column, the A operand of dV); dP^T [kBlockM, 2 kBlockM) with dS^T over
// its first half (A of dK), and dQ_i from its first column once dK_i has read dS^T: head_dim
// columns of queries' lanes, or kDqProducts x kBlockM columns of dims' lanes (192 / 128: dims
// [0, 128) then [64, 192), reaching 64 columns past dP^T); dV from Config::kTmemDvColumn
// (head_dim_v columns); dK from Config::kTmemDkColumn (head_dim).
//
// Step i (MMA thread; MMAs of one thread run in issue order, so a product may overwrite TMEM an
// earlier one reads without a wait between them):
//   S^T_i = K Q_i^T, dP^T_i = V dO_i^T                   (issued during step i - 1)
//   wait P^T_i   -> dV += P^T_i dO_i -> S^T_{i+1} = K Q_{i+1}^T (over P^T_i, read by then)
//   wait dS^T_i  -> dK += dS^T_i Q_i -> dQ_i = dS_i K or dQ_i^T = K^T dS^T_i (over dS^T_i)
//                -> commit dq_full, slot empty
//   wait dQ_i read out of TMEM -> dP^T_{i+1} = V dO_{i+1}^T
// so the compute warps' P^T_{i+1} overlaps dK_i and dQ_i, and their dS^T_i overlaps dV_i and
// S^T_{i+1}.
//
// Shared memory (tiles 1024-byte aligned for the 128-byte swizzle; offsets from
// fagen/model/fa4_bwd.py): K, V (kBlockN rows), kStages Q and dO tiles (kBlockM rows; each tile
// head_dim / 64 column chunks of rows x 128 bytes, as TMA writes them), dS^T (kBlockN key rows,
// two chunks of 64 queries), then the mbarriers and the TMEM address.
#pragma once

#include "fagen/algo/backward_rows.cuh"
#include "fagen/algo/backward_tile.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/algo/mask.cuh"
#include "fagen/algo/score.cuh"
#include "fagen/algo/tma_tile.cuh"
#include "fagen/algo/tmem_allocation.cuh"
#include "fagen/params.h"
#include "fagen/ptx/bar.cuh"
#include "fagen/ptx/cp_async_bulk_tensor.cuh"
#include "fagen/ptx/ex2.cuh"
#include "fagen/ptx/fence.cuh"
#include "fagen/ptx/mbarrier.cuh"
#include "fagen/ptx/red.cuh"
#include "fagen/ptx/setmaxnreg.cuh"
#include "fagen/ptx/tcgen05_commit.cuh"
#include "fagen/ptx/tcgen05_fence.cuh"
#include "fagen/ptx/tcgen05_ld_st.cuh"
#include "fagen/ptx/tcgen05_mma.cuh"
#include "fagen/types.cuh"

namespace fagen::fa4 {

template <class Config>
struct Backward {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;
    using Mask = algo::AttentionMask<Config::kMask>;
    using Score = algo::ScoreMod<Config::kSoftcap, Config::kAlibi>;
    using Rows = algo::BackwardRows<Element, Config::kHeadDim, Config::kHeadDimV, Config::kBwdRowsPerCta,
                                    Config::kBwdRowThreads, Config::kDqAccumRowAlign, Config::kSinks,
                                    /*kFragmentTiles=*/false, Config::kVarlen>;
    using Walk = algo::BackwardWalk<Mask, typename Rows::Row, Config::kBlockM, Config::kBlockN>;

    static constexpr int kHeadDim = Config::kHeadDim;    // Q, K, dQ, dK columns
    static constexpr int kHeadDimV = Config::kHeadDimV;  // V, dO, dV columns
    static constexpr int kBlockM = Config::kBlockM;      // queries per step
    static constexpr int kBlockN = Config::kBlockN;      // keys per CTA
    static constexpr int kStages = Config::kStages;
    static constexpr uint32_t kKBytes = kBlockN * kHeadDim * 2;
    static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * 2;
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;
    static constexpr uint32_t kDoBytes = kBlockM * kHeadDimV * 2;
    static constexpr uint32_t kAtom = algo::kSwizzleAtomBytes;
    // TMEM columns (see the top of the file).
    static constexpr uint32_t kSColumn = 0;
    static constexpr uint32_t kDpColumn = kBlockM;
    static constexpr uint32_t kDqColumn = kDpColumn;
    static constexpr int kDqProducts = Config::kDqProducts;
    static constexpr uint32_t kDqColumns = Config::kDqTransposed ? kDqProducts * kBlockM : kHeadDim;
    static constexpr uint32_t kDvColumn = Config::kTmemDvColumn;
    static constexpr uint32_t kDkColumn = Config::kTmemDkColumn;
    static constexpr int kMmaM = 128;  // every product's M: a TMEM lane per row
    // Instruction descriptors: S^T and dP^T (keys x queries; both operands K-major), dV and dK
    // (keys x columns; A from TMEM, B = dO or Q read MN-major), dQ (queries x head_dim; A = dS
    // read MN-major from the dS^T tile, B = K read MN-major) or dQ^T (128 dims x queries; A = K^T,
    // read MN-major from the K tile, B = dS^T read MN-major).
    static constexpr uint32_t kScoresInstr =
        ptx::Tcgen05F16InstructionDescriptor<kBlockN, kBlockM, Config::kIsBf16, false>::value;
    static constexpr uint32_t kDvInstr =
        ptx::Tcgen05F16InstructionDescriptor<kBlockN, kHeadDimV, Config::kIsBf16, true>::value;
    static constexpr uint32_t kDkInstr =
        ptx::Tcgen05F16InstructionDescriptor<kBlockN, kHeadDim, Config::kIsBf16, true>::value;
    static constexpr uint32_t kDqInstr =
        Config::kDqTransposed
            ? ptx::Tcgen05F16InstructionDescriptor<kMmaM, kBlockM, Config::kIsBf16, true, true>::value
            : ptx::Tcgen05F16InstructionDescriptor<kBlockM, kHeadDim, Config::kIsBf16, true, true>::value;

    static_assert(kBlockN == kMmaM, "a TMEM lane per key");
    static_assert(Config::kDqTransposed == (kBlockM < kMmaM) && (kBlockM == 128 || kBlockM == 64),
                  "dQ_i has a lane per query when a step fills the lanes, else per head-dim column");
    static_assert(!Config::kDqTransposed || kDqProducts == (kHeadDim + kMmaM - 1) / kMmaM);
    static_assert(Config::kThreads == 12 * 32);
    static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0, "TMA boxes and swizzle atoms are 64 columns");
    static_assert(kDvColumn == kDpColumn + (kDqColumns > uint32_t(kBlockM) ? kDqColumns : uint32_t(kBlockM)) &&
                      kDkColumn == kDvColumn + kHeadDimV,
                  "dQ_i takes dP^T's columns and those up to dV's (fagen/model/fa4_bwd.py)");
    static_assert(kDkColumn + kHeadDim <= Config::kTmemColumns && Config::kTmemColumns <= 512);
    static_assert((Config::kTmemColumns & (Config::kTmemColumns - 1)) == 0 && Config::kTmemColumns >= 32,
                  "tcgen05.alloc takes a power of two >= 32");
    static_assert(!Config::kSoftcap || kBlockM == 64, "1 - u^2 beside each probability: fa4_bwd.py's softcap rule");
    static_assert(Config::kSmemKOffset == 0 && Config::kSmemVOffset == kKBytes &&
                  Config::kSmemQOffset == kKBytes + kVBytes &&
                  Config::kSmemDoOffset == Config::kSmemQOffset + kStages * kQBytes &&
                  Config::kSmemDsOffset == Config::kSmemDoOffset + kStages * kDoBytes &&
                  Config::kSmemBarrierOffset == Config::kSmemDsOffset + kBlockN * kBlockM * 2,
                  "fagen/model/fa4_bwd.py lays shared memory out the same way");
    static_assert(kKBytes % kAtom == 0 && kVBytes % kAtom == 0 && kQBytes % kAtom == 0 && kDoBytes % kAtom == 0);

    enum Warp : int { kComputeWarp0 = 0, kDqWarp0 = 4, kLoadWarp = 8, kMmaWarp = 9 };
    enum NamedBarrier : int { kDqOrder = 1 };  // the four dQ warps, around the deterministic mode's turn

    // mbarrier slots, 8 bytes each, in this order; then full and empty per Q / dO stage.
    enum Barrier : int {
        kKvFull = 0,     // K and V landed (TMA)
        kSFull = 1,      // S^T_i in TMEM (tcgen05.commit)
        kPFull = 2,      // P^T_i in TMEM (128 compute threads)
        kDpFull = 3,     // dP^T_i in TMEM (tcgen05.commit)
        kDsFull = 4,     // dS^T_i in TMEM and shared memory (128 compute threads)
        kDqFull = 5,     // dQ_i in TMEM (tcgen05.commit)
        kDqEmpty = 6,    // dQ_i read out of TMEM (128 dQ threads)
        kGradsDone = 7,  // the last dK and dV products completed (tcgen05.commit)
        kFixedBarriers = 8,
    };

    struct Smem {
        uint32_t base;
        __device__ uint32_t k() const { return base + Config::kSmemKOffset; }
        __device__ uint32_t v() const { return base + Config::kSmemVOffset; }
        __device__ uint32_t q(int st) const { return base + Config::kSmemQOffset + st * kQBytes; }
        __device__ uint32_t dout(int st) const { return base + Config::kSmemDoOffset + st * kDoBytes; }
        __device__ uint32_t ds() const { return base + Config::kSmemDsOffset; }
        __device__ uint32_t barrier(int index) const { return base + Config::kSmemBarrierOffset + 8 * index; }
        __device__ uint32_t full(int st) const { return barrier(kFixedBarriers + 2 * st); }
        __device__ uint32_t empty(int st) const { return barrier(kFixedBarriers + 2 * st + 1); }
        __device__ uint32_t tmem_slot() const { return barrier(kFixedBarriers + 2 * kStages); }
    };
    static_assert(Config::kSmemControlBytes == 8 * (kFixedBarriers + 2 * kStages) + 16);

    // ---------------------------------------------------------------- load warp
    static __device__ void load(const FagenBwdTmaMaps& maps, const Smem& s, const Walk& w) {
        const int key_row = w.seq.k_begin() + w.key_begin(), batch = w.seq.tma_batch(w.batch);
        ptx::mbarrier_arrive_expect_tx(s.barrier(kKvFull), kKBytes + kVBytes);
        algo::tma_copy_tile<kHeadDim / 64>(maps.k, s.k(), kBlockN, s.barrier(kKvFull), key_row, w.kv_head, batch);
        algo::tma_copy_tile<kHeadDimV / 64>(maps.v, s.v(), kBlockN, s.barrier(kKvFull), key_row, w.kv_head, batch);
        algo::StepCursor at = w.first_step();
        for (int t = 0; t < w.steps(); ++t, at.advance(w.i_begin, w.i_end())) {
            const int st = t % kStages;
            ptx::mbarrier_wait_parity(s.empty(st), algo::ring_parity<kStages>(t) ^ 1);
            ptx::mbarrier_arrive_expect_tx(s.full(st), kQBytes + kDoBytes);
            const int row = w.seq.q_begin() + at.block * kBlockM;
            algo::tma_copy_tile<kHeadDim / 64>(maps.q, s.q(st), kBlockM, s.full(st), row, at.head, batch);
            algo::tma_copy_tile<kHeadDimV / 64>(maps.dout, s.dout(st), kBlockM, s.full(st), row, at.head, batch);
        }
    }

    // ---------------------------------------------------------------- MMA thread
    // TMEM[column] = rows of `a` (K or V, K-major) times the rows of `b` (Q or dO, K-major),
    // transposed: 16 columns of the head dim (32 bytes into the swizzled row) per instruction.
    template <int kColumns>
    static __device__ __forceinline__ void issue_scores(uint32_t tmem, uint32_t a, uint32_t b) {
#pragma unroll
        for (int kk = 0; kk < kColumns / 16; ++kk) {
            const uint32_t k_offset = (kk % 4) * 32;
            ptx::tcgen05_mma_f16_ss(
                tmem, ptx::tcgen05_smem_desc_swizzle128(a + (kk / 4) * kBlockN * 128 + k_offset, 16, kAtom),
                ptx::tcgen05_smem_desc_swizzle128(b + (kk / 4) * kBlockM * 128 + k_offset, 16, kAtom), kScoresInstr,
                kk > 0);
        }
    }

    // TMEM[column] (+)= A (P^T or dS^T from TMEM at a_column: 8 columns = 16 queries per step)
    // times `b` (dO or Q, queries x columns, read MN-major: consecutive 64-column chunks
    // kBlockM * 128 bytes apart).
    static __device__ __forceinline__ void issue_key_grads(uint32_t tmem_d, uint32_t tmem_a, uint32_t b,
                                                           uint32_t instr, bool accumulate) {
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            ptx::tcgen05_mma_f16_ts(tmem_d, tmem_a + kk * 8,
                                    ptx::tcgen05_smem_desc_swizzle128(b + kk * 16 * 128, kBlockM * 128, kAtom),
                                    instr, accumulate || kk > 0);
        }
    }

    // dQ_i = dS K: A = dS read MN-major from the dS^T tile (queries contiguous, two chunks of 64
    // kBlockN * 128 bytes apart), B = K read MN-major; 16 keys per instruction. Transposed: dQ_i^T
    // = K^T dS^T, product j over the 128 dims from first_dim(j) (A = K^T: the K tile read
    // MN-major from that dim's chunk; B = dS^T read MN-major), kBlockM columns each.
    static __device__ __forceinline__ uint32_t first_dim(int product) {
        static_assert(!Config::kDqTransposed || kHeadDim >= kMmaM);
        return product + 1 < kDqProducts ? product * kMmaM : kHeadDim - kMmaM;
    }

    static __device__ __forceinline__ void issue_dq(uint32_t tmem_d, const Smem& s) {
        const auto operand = [](uint32_t tile, int kk) {
            return ptx::tcgen05_smem_desc_swizzle128(tile + kk * 16 * 128, kBlockN * 128, kAtom);
        };
#pragma unroll
        for (int j = 0; j < kDqProducts; ++j) {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                if constexpr (Config::kDqTransposed) {
                    ptx::tcgen05_mma_f16_ss(tmem_d + j * kBlockM, operand(s.k() + first_dim(j) / 64 * kBlockN * 128, kk),
                                            operand(s.ds(), kk), kDqInstr, kk > 0);
                } else {
                    ptx::tcgen05_mma_f16_ss(tmem_d, operand(s.ds(), kk), operand(s.k(), kk), kDqInstr, kk > 0);
                }
            }
        }
    }

    static __device__ void mma(const Smem& s, const Walk& w, uint32_t tmem) {
        const int steps = w.steps();
        ptx::mbarrier_wait_parity(s.barrier(kKvFull), 0);
        ptx::mbarrier_wait_parity(s.full(0), 0);
        ptx::tcgen05_fence_after_thread_sync();
        issue_scores<kHeadDim>(tmem + kSColumn, s.k(), s.q(0));
        ptx::tcgen05_commit(s.barrier(kSFull));
        issue_scores<kHeadDimV>(tmem + kDpColumn, s.v(), s.dout(0));
        ptx::tcgen05_commit(s.barrier(kDpFull));
        for (int t = 0; t < steps; ++t) {
            const int st = t % kStages, next = (t + 1) % kStages;
            const uint32_t parity = t & 1;
            ptx::mbarrier_wait_parity(s.barrier(kPFull), parity);
            ptx::tcgen05_fence_after_thread_sync();
            issue_key_grads(tmem + kDvColumn, tmem + kSColumn, s.dout(st), kDvInstr, t > 0);
            if (t + 1 < steps) {
                ptx::mbarrier_wait_parity(s.full(next), algo::ring_parity<kStages>(t + 1));
                ptx::tcgen05_fence_after_thread_sync();
                issue_scores<kHeadDim>(tmem + kSColumn, s.k(), s.q(next));
                ptx::tcgen05_commit(s.barrier(kSFull));
            }
            ptx::mbarrier_wait_parity(s.barrier(kDsFull), parity);
            ptx::tcgen05_fence_after_thread_sync();
            issue_key_grads(tmem + kDkColumn, tmem + kDpColumn, s.q(st), kDkInstr, t > 0);
            issue_dq(tmem + kDqColumn, s);
            ptx::tcgen05_commit(s.barrier(kDqFull));
            ptx::tcgen05_commit(s.empty(st));
            if (t + 1 < steps) {
                ptx::mbarrier_wait_parity(s.barrier(kDqEmpty), parity);
                ptx::tcgen05_fence_after_thread_sync();
                issue_scores<kHeadDimV>(tmem + kDpColumn, s.v(), s.dout(next));
                ptx::tcgen05_commit(s.barrier(kDpFull));
            }
        }
        ptx::tcgen05_commit(s.barrier(kGradsDone));
    }

    // ---------------------------------------------------------------- compute warps
    // kColumns fp32 cells of this thread's lane from `taddr` on, into `out`.
    template <int kColumns>
    static __device__ __forceinline__ void load_row(uint32_t taddr, float (&out)[kColumns]) {
        uint32_t raw[kColumns / 16][16];
#pragma unroll
        for (int c = 0; c < kColumns / 16; ++c) ptx::tcgen05_ld_32x32b_x16(taddr + c * 16, raw[c]);
        ptx::tcgen05_wait_ld();
#pragma unroll
        for (int c = 0; c < kColumns / 16; ++c) {
            ptx::tcgen05_ld_fence_registers(raw[c]);
#pragma unroll
            for (int i = 0; i < 16; ++i) out[c * 16 + i] = __uint_as_float(raw[c][i]);
        }
    }

    // dS^T of this thread's key (32 queries from `query0` of the step, 16-bit pairs) into the
    // dS^T tile: its row of 64-query chunks, 16-byte unit u of row r at u ^ (r % 8), so that the
    // 8 rows of a bank group's units land in distinct banks.
    static __device__ __forceinline__ void store_ds_row(uint32_t tile, int key, int query0, const uint32_t (&packed)[16]) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int unit = (query0 % 64) / 8 + u;
            const uint32_t at = (query0 / 64) * kBlockN * 128 + key * 128 + ((unit ^ (key % 8)) * 16);
            *static_cast<uint4*>(__cvta_shared_to_generic(tile + at)) =
                make_uint4(packed[4 * u], packed[4 * u + 1], packed[4 * u + 2], packed[4 * u + 3]);
        }
    }

    // A per-query array of the workspace (LSE, D) for the step's kBlockM queries, held by a warp:
    // lane l has queries l, l + 32, ...
    struct LaneRows {
        float v[kBlockM / 32];

        static __device__ __forceinline__ LaneRows of(const float* array, long long head_rows, int row_begin,
                                                      int seqlen_q, int lane) {
            LaneRows r;
#pragma unroll
            for (int j = 0; j < kBlockM / 32; ++j) r.v[j] = array[head_rows + min(row_begin + 32 * j + lane, seqlen_q - 1)];
            return r;
        }
        // Query c's value, in every lane (c a compile-time index after unrolling).
        __device__ __forceinline__ float at(int c) const { return __shfl_sync(0xffffffffu, v[c / 32], c % 32); }
    };

    // The element-wise work of every step for key `row` of the tile: P^T from S^T, then dS^T
    // from dP^T. A step whose block holds a masked pair, or queries past seqlen_q, masks element
    // by element (their probabilities 0); the others do not test at all.
    static __device__ void compute(const FagenBwdParams& p, const Smem& s, const Walk& w, uint32_t tmem, int row) {
        const int lane = row % 32;
        const uint32_t lane_base = tmem + (static_cast<uint32_t>(row & ~31) << 16);
        const Mask mask = w.mask(p);
        const int key = w.key_begin() + row;
        const int seqlen_q = w.seq.seqlen_q(p);
        algo::StepCursor at = w.first_step();
        for (int t = 0; t < w.steps(); ++t, at.advance(w.i_begin, w.i_end())) {
            const uint32_t parity = t & 1;
            const int row_begin = at.block * kBlockM;
            // LSE and D of the step's queries, spread over the warp's lanes (lane l holds queries
            // l, 32 + l, ...) and handed to every lane by shuffles: 8 registers, where every
            // thread loading all 128 (broadcast loads the compiler hoisted) spilled 1.1 KB.
            // Queries past seqlen_q take the last row's and are masked.
            const LaneRows lse2 = LaneRows::of(p.lse_log2, w.head_row0(p, at.head), row_begin, seqlen_q, lane);
            const LaneRows dsum = LaneRows::of(p.softmax_d, w.head_row0(p, at.head), row_begin, seqlen_q, lane);
            const bool needs_mask = mask.block_needs_mask(w.n_block, row_begin, kBlockM, kBlockN) ||
                                    row_begin + kBlockM > seqlen_q;
            const Score score = Score::of(p, w.batch, at.head, seqlen_q, w.seq.seqlen_k(p));

            ptx::mbarrier_wait_parity(s.barrier(kSFull), parity);
            ptx::tcgen05_fence_after_thread_sync();
            float probs[kBlockM];
            float dsoftcap[Config::kSoftcap ? kBlockM : 1];  // 1 - u^2 of each score (algo/score.cuh)
            load_row(lane_base + kSColumn, probs);
#pragma unroll
            for (int c = 0; c < kBlockM; ++c) {
                float u = probs[c];
                if constexpr (!Score::kIdentity) u = score.modify(u, row_begin + c, key, dsoftcap[Config::kSoftcap ? c : 0]);
                probs[c] = ptx::ex2_approx_ftz(algo::backward_exponent(u, p.scale_log2, lse2.at(c)));
            }
            if (needs_mask) {
#pragma unroll
                for (int c = 0; c < kBlockM; ++c) {
                    if (row_begin + c >= seqlen_q || mask.masked(row_begin + c, key)) probs[c] = 0.f;
                }
            }
#pragma unroll
            for (int c = 0; c < kBlockM / 32; ++c) {
                uint32_t packed[16];
#pragma unroll
                for (int i = 0; i < 16; ++i) packed[i] = Ops::pack(probs[32 * c + 2 * i], probs[32 * c + 2 * i + 1]);
                ptx::tcgen05_st_32x32b_x16(lane_base + kSColumn + c * 16, packed);
            }
            ptx::tcgen05_wait_st();
            ptx::tcgen05_fence_before_thread_sync();
            ptx::mbarrier_arrive(s.barrier(kPFull));

            ptx::mbarrier_wait_parity(s.barrier(kDpFull), parity);
            ptx::tcgen05_fence_after_thread_sync();
#pragma unroll
            for (int c = 0; c < kBlockM / 32; ++c) {
                float dp[32];
                load_row(lane_base + kDpColumn + c * 32, dp);
                uint32_t packed[16];
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    const int q0 = 32 * c + 2 * i;
                    float ds0 = probs[q0] * (dp[2 * i] - dsum.at(q0));
                    float ds1 = probs[q0 + 1] * (dp[2 * i + 1] - dsum.at(q0 + 1));
                    if constexpr (Config::kSoftcap) {
                        ds0 *= dsoftcap[q0];
                        ds1 *= dsoftcap[q0 + 1];
                    }
                    packed[i] = Ops::pack(ds0, ds1);
                }
                ptx::tcgen05_st_32x32b_x16(lane_base + kDpColumn + c * 16, packed);
                store_ds_row(s.ds(), row, 32 * c, packed);
            }
            ptx::tcgen05_wait_st();
            ptx::tcgen05_fence_before_thread_sync();
            ptx::fence_proxy_async_shared_cta();  // dS^T was written through the generic proxy
            ptx::mbarrier_arrive(s.barrier(kDsFull));
        }
    }

    // ---------------------------------------------------------------- dQ warps
    // Lane `row` of dQ_i^T product j is dim first_dim(j) + row; the lanes of dims an earlier
    // product has (whole warps: [0, 64) of [64, 192)) leave it alone.
    static __device__ __forceinline__ bool owns_dim(int product, int row) {
        return !Config::kDqTransposed || static_cast<int>(first_dim(product)) + row >= product * kMmaM;
    }
    static_assert(!Config::kDqTransposed || (kDqProducts * kMmaM - kHeadDim) % 32 == 0,
                  "a product's lanes of earlier dims are whole warps (tcgen05.ld is per warp)");

    // Per step: lane `row`'s dQ_i values out of TMEM (which frees them for dP^T_{i+1}), then into
    // the accumulator: query `row`'s row by 16-byte reductions, or (transposed) dim `row`'s value
    // of each query by 4-byte ones, a warp's 32 dims one 128-byte line; rows past seqlen_q add
    // nothing. Deterministic mode: the four warps take their turn on the query block's counter
    // together.
    static __device__ void write_dq(const FagenBwdParams& p, const Smem& s, const Walk& w, uint32_t tmem, int row) {
        const uint32_t lane_base = tmem + (static_cast<uint32_t>(row & ~31) << 16);
        const int seqlen_q = w.seq.seqlen_q(p);
        const bool ordered = p.dq_semaphore != nullptr;
        algo::StepCursor at = w.first_step();
        for (int t = 0; t < w.steps(); ++t, at.advance(w.i_begin, w.i_end())) {
            ptx::mbarrier_wait_parity(s.barrier(kDqFull), t & 1);
            ptx::tcgen05_fence_after_thread_sync();
            float dq[kDqProducts][kDqColumns / kDqProducts];
#pragma unroll
            for (int j = 0; j < kDqProducts; ++j) {
                if (owns_dim(j, row)) load_row(lane_base + kDqColumn + j * (kDqColumns / kDqProducts), dq[j]);
            }
            ptx::tcgen05_fence_before_thread_sync();
            ptx::mbarrier_arrive(s.barrier(kDqEmpty));

            const int query = at.block * kBlockM + row;
            int* semaphore = ordered ? Walk::Order::semaphore(p, w.batch * p.heads_q + at.head, at.block) : nullptr;
            if (ordered) {
                if (row == 0) {
                    const int rank = Walk::Order::rank(w.mask(p), at.block, w.n_block);
                    while (atomicAdd(semaphore, 0) != rank) {
                    }
                    __threadfence();
                }
                ptx::bar_sync(kDqOrder, 128);
            }
            if constexpr (Config::kDqTransposed) {
                const long long head = Rows::accum_head(p, w.seq, w.batch, w.batch * p.heads_q + at.head);
                const int queries = min(kBlockM, seqlen_q - at.block * kBlockM);
#pragma unroll
                for (int j = 0; j < kDqProducts; ++j) {
                    if (!owns_dim(j, row)) continue;
                    float* column = p.dq_accum + head + static_cast<long long>(at.block) * kBlockM * kHeadDim +
                                    first_dim(j) + row;
#pragma unroll
                    for (int c = 0; c < kBlockM; ++c) {
                        if (c < queries) ptx::red_global_add_f32(column + c * kHeadDim, dq[j][c]);
                    }
                }
            } else if (query < seqlen_q) {
                float* at_row = p.dq_accum + Rows::accum_head(p, w.seq, w.batch, w.batch * p.heads_q + at.head) +
                                static_cast<long long>(query) * kHeadDim;
#pragma unroll
                for (int c = 0; c < kHeadDim; c += 4) {
                    ptx::red_global_add_v4_f32(at_row + c, dq[0][c], dq[0][c + 1], dq[0][c + 2], dq[0][c + 3]);
                }
            }
            if (ordered) {
                __threadfence();
                ptx::bar_sync(kDqOrder, 128);
                if (row == 0) atomicAdd(semaphore, 1);
            }
        }
    }

    // kColumns of key `row`'s gradient from TMEM, times `scale`, to its row at `out` (16-byte
    // stores), unless the key is past seqlen_k; zeros for a tile without steps.
    template <int kColumns>
    static __device__ __forceinline__ void store_key_row(Element* out, uint32_t taddr, float scale, bool have_steps,
                                                         bool valid) {
#pragma unroll
        for (int c = 0; c < kColumns / 16; ++c) {
            float g[16];
            if (have_steps) {
                load_row(taddr + c * 16, g);
            } else {
#pragma unroll
                for (int i = 0; i < 16; ++i) g[i] = 0.f;
            }
            uint32_t packed[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) packed[i] = Ops::pack(g[2 * i] * scale, g[2 * i + 1] * scale);
            if (valid) {
                uint4* at = reinterpret_cast<uint4*>(out + c * 16);
                at[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                at[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
            }
        }
    }

    static __device__ void write_key_grads(const FagenBwdParams& p, const Smem& s, const Walk& w, uint32_t tmem,
                                           int row) {
        const bool have_steps = w.steps() > 0;
        if (have_steps) {
            ptx::mbarrier_wait_parity(s.barrier(kGradsDone), 0);
            ptx::tcgen05_fence_after_thread_sync();
        }
        const uint32_t lane_base = tmem + (static_cast<uint32_t>(row & ~31) << 16);
        const int key = w.key_begin() + row;
        const bool valid = key < w.seq.seqlen_k(p);
        const long long key_row = w.seq.k_begin() + key;  // in dK, dV
        Element* dk = static_cast<Element*>(p.dk) + w.batch * p.dk_batch_stride + w.kv_head * p.dk_head_stride +
                      key_row * p.dk_row_stride;
        Element* dv = static_cast<Element*>(p.dv) + w.batch * p.dv_batch_stride + w.kv_head * p.dv_head_stride +
                      key_row * p.dv_row_stride;
        store_key_row<kHeadDimV>(dv, lane_base + kDvColumn, 1.f, have_steps, valid);
        store_key_row<kHeadDim>(dk, lane_base + kDkColumn, p.softmax_scale, have_steps, valid);
    }

    // ---------------------------------------------------------------- entry
    static __device__ void run(const FagenBwdParams& p, const FagenBwdTmaMaps& maps, char* smem) {
        const Smem s{algo::swizzle_aligned_base(smem)};
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

        if (threadIdx.x == 0) {
            ptx::prefetch_tensormap(&maps.q);
            ptx::prefetch_tensormap(&maps.k);
            ptx::prefetch_tensormap(&maps.v);
            ptx::prefetch_tensormap(&maps.dout);
            for (int b = 0; b < kFixedBarriers; ++b) {
                const bool threads_arrive = b == kPFull || b == kDsFull || b == kDqEmpty;
                ptx::mbarrier_init(s.barrier(b), threads_arrive ? 128 : 1);
            }
            for (int st = 0; st < kStages; ++st) {
                ptx::mbarrier_init(s.full(st), 1);
                ptx::mbarrier_init(s.empty(st), 1);
            }
            ptx::fence_mbarrier_init_release_cluster();
        }
        const uint32_t tmem = algo::allocate_tmem<Config::kTmemColumns>(s.tmem_slot(), warp == kMmaWarp);

        // Each role computes the tile's walk after its setmaxnreg: values of one kept across it
        // spilled (varlen, 2026-12-04).
        if (warp < kDqWarp0) {
            ptx::setmaxnreg_inc<Config::kComputeRegisters>();
            const Walk w = Walk::of_cta(p);
            if (w.steps() > 0) compute(p, s, w, tmem, threadIdx.x - kComputeWarp0 * 32);
        } else if (warp < kLoadWarp) {
            ptx::setmaxnreg_dec<Config::kDqRegisters>();
            const Walk w = Walk::of_cta(p);
            const int row = threadIdx.x - kDqWarp0 * 32;
            write_dq(p, s, w, tmem, row);
            write_key_grads(p, s, w, tmem, row);
        } else {
            ptx::setmaxnreg_dec<Config::kControlRegisters>();
            const Walk w = Walk::of_cta(p);
            if (w.steps() > 0 && warp == kLoadWarp && lane == 0) load(maps, s, w);
            if (w.steps() > 0 && warp == kMmaWarp && lane == 0) mma(s, w, tmem);
        }
        __syncwarp();

        algo::release_tmem<Config::kTmemColumns>(tmem, threadIdx.x / 32 == kMmaWarp);
    }
};

}  // namespace fagen::fa4
