// fp32 <-> the kernels' 16-bit element types on the host, for the C++ examples' inputs and
// their CPU references.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// Round-to-nearest-even conversions between fp32 and the kernels' 16-bit types.
inline uint16_t to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (std::isnan(x)) return 0x7fc0;
    bits += 0x7fff + ((bits >> 16) & 1);
    return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
}

inline uint16_t to_fp16(float x) {
    // Inputs are N(0, 1) samples: normal range, so no overflow or subnormal handling is needed.
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t sign = (bits >> 16) & 0x8000;
    const float magnitude = std::fabs(x);
    if (magnitude < 6.103515625e-05f) return static_cast<uint16_t>(sign);
    int exponent;
    const float mantissa = std::frexp(magnitude, &exponent);  // magnitude = mantissa * 2^exponent
    const uint32_t significand = static_cast<uint32_t>(std::nearbyint(mantissa * 2048.0f));  // 11 bits
    const uint32_t half = ((static_cast<uint32_t>(exponent + 14)) << 10) + (significand - 1024);
    return static_cast<uint16_t>(sign | half);
}

inline float from_fp16(uint16_t h) {
    const int exponent = (h >> 10) & 0x1f;
    const int mantissa = h & 0x3ff;
    float magnitude;
    if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    else if (exponent == 31) magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
    else magnitude = std::ldexp(static_cast<float>(mantissa + 1024), exponent - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
}

}  // namespace
