// FlashAttention-1 forward (Dao et al., 2022, Algorithm 1) on mma.sync (sm_80 and later).
//
// The seeds' algorithm, kept as the paper states it so that what FlashAttention-2 changed can be
// measured against it (`fagen bench --lineage`):
//
// - Loop order: key/value blocks outer, query blocks inner (Algorithm 1, lines 5 and 7). Each
//   K_j, V_j is loaded into shared memory once; for every query block i the kernel then reads
//   Q_i and the block's running state (O_i, m_i, l_i) from global memory, updates it and writes
//   it back (lines 8-13). Only on a GPU does the state need a home between the two loops: it
//   lives in an fp32 workspace in global memory (the role HBM plays in the paper), as in
//   FlashAttention-1's own CUDA kernels.
// - Rescale *and normalise* every block (line 12): O_i leaves each step divided by the running
//   row sum l_i, so the next step multiplies it back by l_i before adding P V_j. FA2 instead
//   keeps O unnormalised and divides once at the end, and walks keys innermost with O in
//   registers.
// - Parallel over batch and heads only: one CTA per (head, batch) walks every block of its head,
//   as FlashAttention-1 did; FA2's third axis (query blocks across CTAs) is what fills an H200
//   when batch x heads is below its 132 SMs.
//
// GPU practice kept from the kernels fagen already has, since the point is FA1's algorithm and
// not a slower machine: base-2 exponentials with the scale folded in, mma.sync m16n8k16 with
// fp32 accumulation, ldmatrix, cp.async, the Q tile of the next query block loading while the
// current one computes, causal blocks that see no key skipped, fully masked rows giving 0 and
// LSE -inf. The last key block a query block sees writes its final O (in the element type) and
// LSE instead of the workspace.
//
// Workspace (one fp32 buffer, Config::kWorkspaceFloatsPerRow floats per query row of every head
// and batch): rows * head_dim floats of O, then two floats (m, l) per row.
#pragma once
#include "fagen/types.cuh"

#include "fagen/algo/mask.cuh"
#include "fagen/algo/online_softmax.cuh"
#include "fagen/algo/smem_rows.cuh"
#include "fagen/algo/tile_output.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/params.h"
#include "fagen/ptx/cp_async.cuh"
#include "fagen/ptx/ex2.cuh"
#include "fagen/ptx/ldmatrix.cuh"

namespace fagen::fa1 {

template <class Config>
struct Forward {
    using Element = typename Config::Element;
    using Ops = algo::ElementOps<Element>;

    static constexpr int kThreads = Config::kThreads;
    static constexpr int kPitch = Config::kRowPitchBytes;
    static constexpr int kSTiles = Config::kBlockN / 8;    // n8 tiles of S per warp
    static constexpr int kOTiles = Config::kHeadDim / 8;   // n8 tiles of O per warp
    static constexpr int kQKSteps = Config::kHeadDim / 16;
    static constexpr int kPVSteps = Config::kBlockN / 16;

    static_assert(Config::kWarpRows == 16, "a warp owns one m16 tile of every query block");
    static_assert(Config::kBlockM == 16 * Config::kWarps);
    static_assert(Config::kHeadDim % 16 == 0 && Config::kBlockN % 16 == 0,
                  "ldmatrix.x4 loads operand pairs of 16 columns");
    static_assert(kPitch % 16 == 0 && (kPitch / 16) % 2 == 1,
                  "an odd number of 16-byte vectors per row keeps ldmatrix conflict-free");
    static_assert(Config::kWorkspaceFloatsPerRow == Config::kHeadDim + 2);

    // Running state of one query row between key blocks, in the workspace.
    struct RowState {
        float max;  // m: raw-score units (the scale is applied in the exponent)
        float sum;  // l
    };

    static __device__ __forceinline__ float* state_floats(float* workspace, const FagenFwdParams& p) {
        return workspace + static_cast<long long>(p.batch) * p.heads_q * p.seqlen_q * Config::kHeadDim;
    }

    static __device__ void run(const FagenFwdParams& p, float* workspace, char* smem) {
        const int tid = threadIdx.x;
        const int warp = tid / 32;
        const int lane = tid % 32;
        const int head = blockIdx.x;
        const int batch = blockIdx.y;
        const int kv_head = head / (p.heads_q / p.heads_kv);
        const int warp_row = warp * 16;
        // FA1 is the lineage's first step: the full and causal masks only (fagen/model/fa1.py).
        static_assert(Config::kMask != algo::MaskKind::kLocal);
        const auto mask = algo::AttentionMask<Config::kMask>::of(p);
        const int m_blocks = (p.seqlen_q + Config::kBlockM - 1) / Config::kBlockM;
        const int n_blocks = (p.seqlen_k + Config::kBlockN - 1) / Config::kBlockN;

        const Element* q_head = static_cast<const Element*>(p.q) + batch * p.q_batch_stride +
                                head * p.q_head_stride;
        const Element* k = static_cast<const Element*>(p.k) + batch * p.k_batch_stride +
                           kv_head * p.k_head_stride;
        const Element* v = static_cast<const Element*>(p.v) + batch * p.v_batch_stride +
                           kv_head * p.v_head_stride;
        // This head's rows of the workspace: O rows, then (m, l) per row.
        const long long head_row0 = (static_cast<long long>(batch) * p.heads_q + head) * p.seqlen_q;
        float* o_state = workspace + head_row0 * Config::kHeadDim;
        RowState* row_state = reinterpret_cast<RowState*>(state_floats(workspace, p)) + head_row0;

        const uint32_t smem_q = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
        const uint32_t smem_k = smem_q + 2 * Config::kSmemQBytes;  // two Q buffers take turns
        const uint32_t smem_v = smem_k + Config::kBlockN * kPitch;
        auto q_buffer = [&](int i) { return smem_q + (i % 2) * Config::kSmemQBytes; };
        auto load_q = [&](int i) {
            const int row_begin = i * Config::kBlockM;
            algo::load_rows<Element, Config::kBlockM, Config::kHeadDim, kPitch, kThreads>(
                q_buffer(i), q_head + row_begin * p.q_row_stride, p.q_row_stride,
                p.seqlen_q - row_begin, tid);
        };

        // Query blocks none of whose rows sees a key are written once, here.
        for (int i = 0; i < m_blocks; ++i) {
            const int row_begin = i * Config::kBlockM;
            if (mask.key_blocks(row_begin, Config::kBlockM, Config::kBlockN).count() <= 0) {
                algo::write_empty_rows<Element, Config::kBlockM, Config::kHeadDim, kThreads>(
                    algo::tile_output<Element>(p, batch, head, row_begin), p.o_row_stride,
                    algo::tile_lse(p, batch, head, row_begin), p.seqlen_q - row_begin, tid);
            }
        }

        const uint32_t q_lane = (warp_row + lane % 16) * kPitch + (lane / 16) * 16;
        const uint32_t k_lane = (lane % 8 + 8 * (lane / 16)) * kPitch + ((lane / 8) % 2) * 16;
        const uint32_t v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + (lane / 16) * 16;

        for (int j = 0; j < n_blocks; ++j) {  // outer loop: key/value blocks
            // The query blocks whose rows see keys of block j: under the causal mask, the ones
            // from the first whose last row reaches key j * block_n on.
            int i_begin = 0;
            while (i_begin < m_blocks &&
                   mask.key_blocks(i_begin * Config::kBlockM, Config::kBlockM, Config::kBlockN).end <= j) {
                ++i_begin;
            }
            if (i_begin == m_blocks) break;  // (causal) no query block sees block j or later
            __syncthreads();  // every warp is done with K_{j-1}, V_{j-1} and the Q buffers
            const int key_begin = j * Config::kBlockN;
            algo::load_rows<Element, Config::kBlockN, Config::kHeadDim, kPitch, kThreads>(
                smem_k, k + key_begin * p.k_row_stride, p.k_row_stride, p.seqlen_k - key_begin, tid);
            algo::load_rows<Element, Config::kBlockN, Config::kHeadDim, kPitch, kThreads>(
                smem_v, v + key_begin * p.v_row_stride, p.v_row_stride, p.seqlen_k - key_begin, tid);
            load_q(i_begin);
            ptx::cp_async_commit_group();

            for (int i = i_begin; i < m_blocks; ++i) {  // inner loop: query blocks
                ptx::cp_async_wait_group<0>();
                __syncthreads();  // Q_i (and K_j, V_j) landed; every warp is done with Q_{i-1}
                if (i + 1 < m_blocks) load_q(i + 1);
                ptx::cp_async_commit_group();
                const int row_begin = i * Config::kBlockM;
                const bool last_block =
                    j == mask.key_blocks(row_begin, Config::kBlockM, Config::kBlockN).end - 1;
                update_block(p, o_state, row_state, q_buffer(i) + q_lane, smem_k + k_lane,
                             smem_v + v_lane, mask, batch, head, row_begin, warp_row, lane, j,
                             last_block);
            }
        }
        ptx::cp_async_wait_group<0>();
    }

    // Algorithm 1, lines 9-13, for one warp's 16 rows of query block i and key block j: S,
    // the block's max and probabilities, the new (m, l), and O_i = (l_i e^{m_i - m} O_i + P V_j) / l.
    static __device__ void update_block(const FagenFwdParams& p, float* o_state,
                                        RowState* row_state, uint32_t q_addr, uint32_t k_addr,
                                        uint32_t v_addr,
                                        const algo::AttentionMask<Config::kMask>& mask,
                                        int batch, int head, int row_begin, int warp_row,
                                        int lane, int j, bool last_block) {
        float acc_s[1][kSTiles][4];
        algo::clear_fragment(acc_s);
#pragma unroll
        for (int kk = 0; kk < kQKSteps; ++kk) {
            uint32_t a[4];
            ptx::ldmatrix_x4(a, q_addr + kk * 32);
#pragma unroll
            for (int np = 0; np < kSTiles / 2; ++np) {
                uint32_t b[4];
                ptx::ldmatrix_x4(b, k_addr + np * 16 * kPitch + kk * 32);
                algo::mma_two_n8<Ops>(acc_s[0][2 * np], acc_s[0][2 * np + 1], a, b);
            }
        }
        if (mask.block_needs_mask(j, row_begin + warp_row, 16, Config::kBlockN)) {
            mask.apply(acc_s, lane, row_begin + warp_row, j * Config::kBlockN);
        }

        // This thread's two rows (fragment rows lane/4 and lane/4 + 8 of the warp's m16 tile).
        const int rows_valid = p.seqlen_q - row_begin;
        float old_weight[2];  // l_i e^{m_i - m}: what the stored (normalised) O_i is multiplied by
        float new_sum[2];
        float new_max[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row + lane / 4 + 8 * h;
            RowState old{algo::neg_inf(), 0.f};
            if (j > 0 && row < rows_valid) old = row_state[row_begin + row];
            float block_max = old.max;
#pragma unroll
            for (int n = 0; n < kSTiles; ++n) {
                block_max = fmaxf(block_max, fmaxf(acc_s[0][n][2 * h], acc_s[0][n][2 * h + 1]));
            }
            const algo::ReferenceMax next =
                algo::next_reference_max<false>(old.max, algo::quad_max(block_max), p.scale_log2, 0.f);
            const float subtrahend = algo::reference_scaled(next.value, p.scale_log2);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float& s = acc_s[0][n][2 * h + c];
                    s = ptx::ex2_approx_ftz(fmaf(s, p.scale_log2, -subtrahend));
                    sum += s;
                }
            }
            // A row that has seen no key keeps (m, l) = (-inf, 0) and weight 0 for its O.
            old_weight[h] = old.sum == 0.f ? 0.f : old.sum * next.rescale;
            new_sum[h] = old_weight[h] + algo::quad_sum(sum);
            new_max[h] = next.value;
        }

        // acc_o = l_i e^{m_i - m} O_i, read from the workspace in the accumulator layout.
        float acc_o[1][kOTiles][4];
#pragma unroll
        for (int n = 0; n < kOTiles; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const algo::FragmentCoord c = algo::fragment_coord(lane, 0, n, 2 * h);
                const int row = warp_row + c.row;
                float2 old = make_float2(0.f, 0.f);
                if (j > 0 && row < rows_valid && old_weight[h] != 0.f) {
                    old = *reinterpret_cast<const float2*>(
                        o_state + (row_begin + row) * static_cast<long long>(Config::kHeadDim) + c.col);
                }
                acc_o[0][n][2 * h] = old.x * old_weight[h];
                acc_o[0][n][2 * h + 1] = old.y * old_weight[h];
            }
        }
        // acc_o += P V_j.
#pragma unroll
        for (int kk = 0; kk < kPVSteps; ++kk) {
            uint32_t a[4];
            algo::pack_a_fragment<Element>(a, acc_s[0], kk);
#pragma unroll
            for (int dp = 0; dp < kOTiles / 2; ++dp) {
                uint32_t b[4];
                ptx::ldmatrix_x4_trans(b, v_addr + kk * 16 * kPitch + dp * 32);
                algo::mma_two_n8<Ops>(acc_o[0][2 * dp], acc_o[0][2 * dp + 1], a, b);
            }
        }

        // Normalise (line 12) and write the state back, or the result after the last block.
        Element* o = algo::tile_output<Element>(p, batch, head, row_begin);
        float* lse = algo::tile_lse(p, batch, head, row_begin);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row + lane / 4 + 8 * h;
            const float inverse = algo::inverse_row_sum(new_sum[h]);
            if (row >= rows_valid) continue;
#pragma unroll
            for (int n = 0; n < kOTiles; ++n) {
                const int col = algo::fragment_coord(lane, 0, n, 2 * h).col;
                const float x = acc_o[0][n][2 * h] * inverse;
                const float y = acc_o[0][n][2 * h + 1] * inverse;
                if (last_block) {
                    *reinterpret_cast<uint32_t*>(o + row * p.o_row_stride + col) = Ops::pack(x, y);
                } else {
                    *reinterpret_cast<float2*>(
                        o_state + (row_begin + row) * static_cast<long long>(Config::kHeadDim) + col) =
                        make_float2(x, y);
                }
            }
            if (lane % 4 == 0) {
                if (!last_block) {
                    row_state[row_begin + row] = RowState{new_max[h], new_sum[h]};
                } else if (lse != nullptr) {
                    lse[row] = algo::row_lse(new_max[h], new_sum[h], p.scale_log2);
                }
            }
        }
    }
};

}  // namespace fagen::fa1
