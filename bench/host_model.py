"""Host time per call of fagen's attention without a GPU: the runtime's and the torch adapter's
forward and backward on the CPU of whatever machine runs it, with cuda-python's driver replaced
by one that answers every call at once (a compute capability 9.0 device, so the bundle's Hopper
kernels are chosen, FA3 with its TMA maps where the bundle has it) and torch CPU tensors. What
is left is fagen's and torch's Python, the part of bench.launch_overhead's numbers that this
repository's code decides (docs/performance.md, entry 167).

The user-facing rows time flash_attn_func on inputs that require grad, its forward alone and
with .backward(), eager and under torch.compile(fullgraph=True), beside torch's SDPA on the
same tensors: torch's own dispatch and autograd plus its real CPU math, which
SDPA_FLOOR_SHAPE's row all but removes.

    python -m bench.host_model [--bundle DIR] [--calls 2000] [--no-compile] [--profile PATH]

--profile writes the cProfile statistics of the eager flash_attn_func forward + backward.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import pstats

import torch

from bench.attention import sdpa
from bench.launch_overhead import SHAPE, host_us_per_call
from fagen.runtime import BackwardPointers, call, driver, prepare_backward
from fagen.torch import adapter, backward, flash_attn_func, get_bundle, kvcache, varlen

USER_SHAPE = (1, 16, 2, 64)  # batch, seqlen, heads, head_dim: SDPA's CPU math tens of microseconds
SDPA_FLOOR_SHAPE = (1, 1, 1, 8)  # SDPA's dispatch and autograd with almost no math
DECODE_BATCH = 4
VARLEN_SEQLENS = (16, 48, 64)  # SHAPE's 128 tokens


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
    patches += [(module, "_current_stream", lambda device: 0) for module in (kvcache, varlen)]
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
    """name -> call without arguments, on bf16 tensors of SHAPE, causal; the decode step (one
    query per sequence, DECODE_BATCH sequences of SHAPE's keys in a cache) and the varlen forward
    (SHAPE's tokens as VARLEN_SEQLENS) as their implementations, which the eager path calls, and
    as their ops, which a compiled graph calls."""
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
    decode = (torch.randn(DECODE_BATCH, 1, heads, head_dim, dtype=torch.bfloat16),
              *(torch.randn(DECODE_BATCH, seqlen, heads, head_dim, dtype=torch.bfloat16) for _ in range(2)),
              torch.full((DECODE_BATCH,), seqlen - 1, dtype=torch.int32), *(None,) * 7,
              1, seqlen, True, -1, -1, None, 0.0, 0, path)
    offsets = torch.tensor([0, *itertools.accumulate(VARLEN_SEQLENS)], dtype=torch.int32)
    packed = (*(t.view(seqlen, heads, head_dim) for t in (q, k, v)), offsets, offsets, None, None, None,
              max(VARLEN_SEQLENS), max(VARLEN_SEQLENS), True, -1, -1, None, 0.0, False, path)
    return {
        "runtime fwd": lambda: call.attention(bundle, problem, *tensors[:4], 9 << 20),
        "runtime fwd, prepared": lambda: prepared.launch(tensors[3].data, 9 << 20, 0),
        "runtime bwd": lambda: call.attention_backward(bundle, problem, backward_tensors, workspace=10 << 20),
        "runtime bwd, prepared": lambda: prepared_backward.launch(pointers, workspace=10 << 20),
        "adapter fwd": lambda: adapter._flash_attn_fwd(q, k, v, None, None, True, -1, -1, 0.0, None, path),
        "adapter bwd": lambda: backward._flash_attn_bwd(dout, q, k, v, out, lse, None, None, True, -1, -1, 0.0,
                                                        None, path, False),
        "kvcache decode": lambda: kvcache._attend(*decode),
        "kvcache decode, op": lambda: kvcache.flash_attn_kvcache(*decode),
        "varlen fwd": lambda: varlen._op_forward(*packed),
        "varlen fwd, op": lambda: varlen.flash_attn_varlen_fwd(*packed),
    }


def user_calls(bundle, compiled: bool) -> dict:
    """name -> call without arguments of flash_attn_func and SDPA on bf16 tensors that require
    grad, causal: the forward, and the forward with .backward() (which adds to the inputs' .grad,
    as a training step's does). SDPA also on SDPA_FLOOR_SHAPE, where its math is next to nothing."""
    def fagen_attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, bundle=bundle)

    def sdpa_attention(q, k, v):
        return sdpa(q, k, v, True).transpose(1, 2)  # the flash-attn layout, like grad

    functions = (("flash_attn_func", USER_SHAPE, fagen_attention), ("SDPA", USER_SHAPE, sdpa_attention),
                 (f"SDPA {SDPA_FLOOR_SHAPE}", SDPA_FLOOR_SHAPE, sdpa_attention))
    suffix = ", compiled" if compiled else ""
    rows = {}
    for name, shape, fn in functions:
        q, k, v = (torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(*shape, dtype=torch.bfloat16)
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        rows[f"{name} fwd{suffix}"] = lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)
        rows[f"{name} fwd+bwd{suffix}"] = lambda fn=fn, q=q, k=k, v=v, grad=grad: fn(q, k, v).backward(grad)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--profile", help="write the eager forward + backward's cProfile top entries here")
    args = parser.parse_args(argv)
    bundle = get_bundle(args.bundle)
    # SDPA's CPU math in this thread alone: its parallel loops would otherwise wait for a pool
    # thread that other processes' work can keep off the CPU for a scheduler slice (milliseconds).
    torch.set_num_threads(1)
    with cpu_model():
        rows = {**calls(bundle), **user_calls(bundle, compiled=False)}
        if not args.no_compile:
            rows.update(user_calls(bundle, compiled=True))
        for name, fn in rows.items():
            for _ in range(20):
                fn()
            print(f"{name:40s} {host_us_per_call(fn, args.calls, synchronize=None):8.1f} us per call (host)",
                  flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [rows["flash_attn_func fwd+bwd"]() for _ in range(args.calls)])
            with open(args.profile, "w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
