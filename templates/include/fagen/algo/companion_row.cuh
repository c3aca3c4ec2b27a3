// The row of a split-KV kernel's companion entry point (fagen/contract.py: companion_grid): a
// warp per (batch row, token, head), heads innermost, rows_per_cta warps per CTA.
#pragma once

namespace fagen::algo {

struct CompanionRow {
    int batch, token, head;

    // This warp's row of batch x tokens x heads; false past the last.
    static __device__ __forceinline__ bool of(int rows_per_cta, int batch, int tokens, int heads, CompanionRow& row) {
        const long long index = static_cast<long long>(blockIdx.x) * rows_per_cta + threadIdx.x / 32;
        if (index >= static_cast<long long>(batch) * tokens * heads) return false;
        row.head = static_cast<int>(index % heads);
        row.token = static_cast<int>(index / heads % tokens);
        row.batch = static_cast<int>(index / (static_cast<long long>(heads) * tokens));
        return true;
    }
};

}  // namespace fagen::algo
