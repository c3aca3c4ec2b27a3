// Fixed-width integer names for device code. NVRTC has no <cstdint> without CCCL's
// <cuda/std/cstdint>, which costs seconds per compile; these are all the kernels need.
#pragma once

namespace fagen {

using uint32_t = unsigned int;
static_assert(sizeof(uint32_t) == 4, "uint32_t must be 32 bits");

// A compile-time bool passed as a value, to instantiate one lambda body twice.
template <bool kValue>
struct BoolConstant {
    static constexpr bool value = kValue;
};

// A if kFirst, else B (std::conditional; NVRTC has no <type_traits> without CCCL's, as above).
template <bool kFirst, class A, class B>
struct Pick {
    using type = A;
};
template <class A, class B>
struct Pick<false, A, B> {
    using type = B;
};

}  // namespace fagen
