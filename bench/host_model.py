"""Host time per call of fagen's attention without a GPU: the runtime's and the torch adapter's
forward and backward on the CPU of whatever machine runs it, with cuda-python's driver replaced
by one that answers every call at once (a compute capability 9.0 device, so the bundle's Hopper
kernels are chosen, FA3 with its TMA maps where the bundle has it) and torch CPU tensors. What
is left is fagen's and torch's Python, the part of bench.launch_overhead's numbers that this
repository's code decides (docs/performance.md, entry 167).

    python -m bench.host_model [--bundle DIR] [--calls 2000]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from bench.launch_overhead import SHAPE, host_us_per_call
from fagen.runtime import BackwardPointers, call, driver, prepare_backward
from fagen.torch import adapter, backward, get_bundle


class InstantDriver:
    """The cuda.bindings.driver calls fagen makes, each answered at once as by device 0, whose
    primary context is current (as torch leaves it); the types and enums are the real ones,
    which need no GPU."""

    def __init__(self, real):
        self._real = real
        self._context = real.CUcontext(0x1000)

    def __getattr__(self, name):
        # Kept on the instance: a lookup then costs what one in the real module does.
        value = getattr(self._real, name)
        setattr(self, name, value)
        return value

    def _ok(self, *values):
        return (self._real.CUresult.CUDA_SUCCESS, *values)

    def cuInit(self, flags):
        return self._ok()

    def cuDeviceGet(self, ordinal):
        return self._ok(self._real.CUdevice(ordinal or 0))  # a CPU tensor's device index is None

    def cuDeviceGetAttribute(self, attribute, device):
        attributes = self._real.CUdevice_attribute
        return self._ok({attributes.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
                         attributes.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                         attributes.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132}[attribute])

    def cuDevicePrimaryCtxRetain(self, device):
        return self._ok(self._context)

    def cuCtxGetCurrent(self):
        return self._ok(self._context)

    def cuLibraryLoadData(self, *arguments):
        return self._ok(self._real.CUlibrary(0x2000))

    def cuLibraryGetKernel(self, library, name):
        return self._ok(self._real.CUkernel(0x3000))

    def cuKernelSetAttribute(self, *arguments):
        return self._ok()

    def cuLaunchKernelEx(self, *arguments):
        return self._ok()


@contextlib.contextmanager
def cpu_model():
    """fagen on the InstantDriver and CPU tensors inside; tensor maps are blank (each still
    passes through the runtime's remembering of maps) and the stream is 0."""
    patches = [(driver, "cu", InstantDriver(driver.cu)), (driver, "_initialized", False),
               (driver, "_primary_contexts", {}),
               (driver, "encode_tiled_tensor_map", lambda *arguments: bytes(driver.TENSOR_MAP_BYTES))]
    for module in (adapter, backward):
        patches += [(module, "_check_device", lambda q, k, v: None), (module, "_current_stream", lambda device: 0)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    caches = (driver.compute_capability, driver.multiprocessor_count, call._encode_tensor_map)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for cache in caches:
            cache.cache_clear()


def calls(bundle) -> dict:
    """name -> call without arguments, on bf16 tensors of SHAPE, causal."""
    batch, seqlen, heads, head_dim = SHAPE
    q, k, v, out, dout = (torch.randn(*SHAPE, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(batch, heads, seqlen)
    problem = adapter._problem(q, k, v, True, (-1, -1))
    path = str(bundle.path)
    tensors = [call.Tensor.contiguous(address << 20, seqlen, heads, head_dim) for address in range(1, 9)]
    backward_tensors = call.BackwardTensors(*tensors, lse=9 << 20)
    prepared = call.prepare(bundle, problem, *tensors[:4])
    prepared_backward = prepare_backward(bundle, problem, backward_tensors)
    pointers = BackwardPointers.of(backward_tensors)
    return {
        "runtime fwd": lambda: call.attention(bundle, problem, *tensors[:4], 9 << 20),
        "runtime fwd, prepared": lambda: prepared.launch(tensors[3].data, 9 << 20, 0),
        "runtime bwd": lambda: call.attention_backward(bundle, problem, backward_tensors, workspace=10 << 20),
        "runtime bwd, prepared": lambda: prepared_backward.launch(pointers, workspace=10 << 20),
        "adapter fwd": lambda: adapter._flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, path),
        "adapter bwd": lambda: backward._flash_attn_bwd(dout, q, k, v, out, lse, None, None, True, -1, -1, 0.0,
                                                        None, path, False),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    bundle = get_bundle(args.bundle)
    with cpu_model():
        for name, fn in calls(bundle).items():
            for _ in range(20):
                fn()
            print(f"{name:24s} {host_us_per_call(fn, args.calls, synchronize=None):8.1f} us per call (host)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
