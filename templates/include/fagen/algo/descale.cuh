// The descales of FP8 (e4m3) operands (FagenFwdParams.q_descale, k_descale, v_descale): a
// tensor's stored values times its descale are its values. Each is an fp32 array read at
// [batch * batch_stride + kv_head * head_stride] (strides 0 broadcast); null is a descale of 1.
#pragma once

namespace fagen::algo {

__device__ __forceinline__ float descale(const float* values, long long batch_stride, long long head_stride,
                                         int batch, int kv_head) {
    return values == nullptr ? 1.f : values[batch * batch_stride + kv_head * head_stride];
}

}  // namespace fagen::algo
