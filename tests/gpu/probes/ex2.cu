// Probe of ptx/ex2.cuh (ex2_approx_ftz). Built for the device's own sm_XY (any cc >= 8.0); run by
// tests/gpu/test_ptx_probes.py: y[i] = 2^x[i] for n inputs, grid-stride.
#include "fagen/ptx/ex2.cuh"

extern "C" __global__ void probe_ex2(const float* x, float* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        y[i] = fagen::ptx::ex2_approx_ftz(x[i]);
    }
}
