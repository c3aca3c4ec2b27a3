// The merge of two attention results over disjoint key sets (FagenMergeParams; the paged-layout
// kernels' merge entry point, fagen/contract.py: SPLIT_MERGE_SUFFIX): with m = max(lse_a,
// lse_b), a = exp(lse_a - m), b = exp(lse_b - m): out = (a out_a + b out_b) / (a + b), lse = m +
// log(a + b), in fp32. A row whose two LSEs are -inf (it saw no key in either set) gets 0 and
// -inf; an LSE of +inf or NaN (no attention gives one) propagates as NaN. What vLLM's cascade
// attention, SGLang's merge_state and context parallelism do with a prefix shared by many
// requests and each request's own keys.
#pragma once
#include "fagen/algo/companion_row.cuh"
#include "fagen/algo/element.cuh"
#include "fagen/algo/lse.cuh"
#include "fagen/params.h"

namespace fagen::algo {

// A warp per (batch row, token, head), `rows_per_cta` of them per CTA; each lane moves 16-byte
// vectors (8 elements) of the row, so any head_dim that is a multiple of 8 works.
template <class Element>
__device__ __forceinline__ void merge_states(const FagenMergeParams& p, int rows_per_cta) {
    using Ops = ElementOps<Element>;
    const int lane = threadIdx.x % 32;
    CompanionRow at;
    if (!CompanionRow::of(rows_per_cta, p.batch, p.seqlen, p.heads, at)) return;
    const int batch = at.batch, token = at.token, head = at.head;

    const float lse_a = p.lse_a[batch * p.lse_a_batch_stride + head * p.lse_a_head_stride + token];
    const float lse_b = p.lse_b[batch * p.lse_b_batch_stride + head * p.lse_b_head_stride + token];
    const float top = fmaxf(lse_a, lse_b);
    // Both -inf: a finite pivot keeps exp() from giving NaN, and both weights are 0.
    const float pivot = top == neg_inf() ? 0.f : top;
    const float weight_a = __expf(lse_a - pivot), weight_b = __expf(lse_b - pivot);
    const float total = weight_a + weight_b;
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float scale_a = weight_a * inv, scale_b = weight_b * inv;

    const Element* row_a = static_cast<const Element*>(p.out_a) + batch * p.out_a_batch_stride +
                           token * p.out_a_row_stride + head * p.out_a_head_stride;
    const Element* row_b = static_cast<const Element*>(p.out_b) + batch * p.out_b_batch_stride +
                           token * p.out_b_row_stride + head * p.out_b_head_stride;
    Element* row = static_cast<Element*>(p.out) + batch * p.out_batch_stride + token * p.out_row_stride +
                   head * p.out_head_stride;
    for (int c = 8 * lane; c < p.head_dim; c += 8 * 32) {
        const uint4 a = *reinterpret_cast<const uint4*>(row_a + c);
        const uint4 b = *reinterpret_cast<const uint4*>(row_b + c);
        const uint32_t a_pairs[4] = {a.x, a.y, a.z, a.w}, b_pairs[4] = {b.x, b.y, b.z, b.w};
        uint32_t merged[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 x = Ops::unpack(a_pairs[i]), y = Ops::unpack(b_pairs[i]);
            merged[i] = Ops::pack(fmaf(scale_a, x.x, scale_b * y.x), fmaf(scale_a, x.y, scale_b * y.y));
        }
        *reinterpret_cast<uint4*>(row + c) = make_uint4(merged[0], merged[1], merged[2], merged[3]);
    }
    if (lane == 0 && p.lse != nullptr) {
        p.lse[batch * p.lse_out_batch_stride + head * p.lse_out_head_stride + token] =
            total > 0.f ? pivot + __logf(total) : neg_inf();
    }
}

}  // namespace fagen::algo
