// Fixed-width integer names for device code. NVRTC has no <cstdint> without CCCL's
// <cuda/std/cstdint>, which costs seconds per compile; these are all the kernels need.
#pragma once

namespace fagen {

using uint32_t = unsigned int;
static_assert(sizeof(uint32_t) == 4, "uint32_t must be 32 bits");

}  // namespace fagen
