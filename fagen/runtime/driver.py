"""The only module that talks to the CUDA driver (cuda.bindings.driver); everything else in fagen
goes through these helpers.

Kernels are loaded with the context-independent library API (cuLibraryLoadData,
cuLibraryGetKernel) and launched as CUkernel handles with cuLaunchKernelEx, which runs them in
the calling thread's current context. fagen launches in the device's primary context, the one
torch and the CUDA runtime use (their memory and streams belong to it): `primary_context(n)`
makes it current for the duration of a call and puts back whatever the caller had current
(another device's context, a context of the caller's own, or none).
"""

from __future__ import annotations

import ctypes
import functools
import threading

from cuda.bindings import driver as cu


class DriverError(RuntimeError):
    """A CUDA driver call failed; carries the driver's error name and description."""

    def __init__(self, call: str, code: int, name: str, description: str):
        super().__init__(f"{call} failed: {name} ({description})")
        self.call = call
        self.code = code
        self.name = name


def _error_text(err) -> tuple[str, str]:
    name = getattr(err, "name", str(err))
    try:
        described, text = cu.cuGetErrorString(err)
    except RuntimeError:  # no driver library to ask
        return name, "no description"
    return name, text.decode() if int(described) == 0 and text else "no description"


_SUCCESS = cu.CUresult.CUDA_SUCCESS


def check(call: str, result):
    """Unpack a cuda.bindings return tuple ``(CUresult, *values)``; raise DriverError on failure.

    Returns None, the single value, or a tuple of values.
    """
    if type(result) is tuple and result[0] == _SUCCESS:  # each launch checks: no star-unpacking
        return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name, text = _error_text(err)
        raise DriverError(call, int(err), name, text)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_init_lock = threading.Lock()
_initialized = False
# Primary contexts we retained, by device ordinal; never released: a context torch also uses
# must outlive every fagen kernel, and retaining is reference-counted, so this costs nothing.
_primary_contexts: dict[int, int] = {}


def init() -> None:
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            check("cuInit", cu.cuInit(0))
            _initialized = True


def device_handle(ordinal: int):
    init()
    return check("cuDeviceGet", cu.cuDeviceGet(ordinal))


@functools.lru_cache(maxsize=None)
def multiprocessor_count(ordinal: int) -> int:
    """SMs of device `ordinal` (a persistent grid has one CTA per SM)."""
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr, device_handle(ordinal))))


@functools.lru_cache(maxsize=None)
def compute_capability(ordinal: int) -> tuple[int, int]:
    attrs = cu.CUdevice_attribute
    device = device_handle(ordinal)
    return tuple(
        int(check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr, device)))
        for attr in (attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                     attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))


def current_device() -> int | None:
    """Ordinal of the device of the calling thread's current context, None if there is none."""
    init()
    ctx = check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
    if int(ctx) == 0:
        return None
    return int(check("cuCtxGetDevice", cu.cuCtxGetDevice()))


def _primary_context(ordinal: int) -> int:
    primary = _primary_contexts.get(ordinal)
    if primary is None:
        with _init_lock:
            if ordinal not in _primary_contexts:
                handle = check("cuDevicePrimaryCtxRetain",
                               cu.cuDevicePrimaryCtxRetain(device_handle(ordinal)))
                _primary_contexts[ordinal] = int(handle)
            primary = _primary_contexts[ordinal]
    return primary


class primary_context:  # noqa: N801 (used like a function: `with primary_context(n):`)
    """``with primary_context(ordinal):`` device `ordinal`'s primary context is current inside,
    and the caller's current context (whatever it was, or none) is current again after. Costs
    one cuCtxGetCurrent when the primary context is current already (a torch process)."""

    __slots__ = ("ordinal", "pushed")

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.pushed = False

    def __enter__(self) -> "primary_context":
        init()
        primary = _primary_context(self.ordinal)
        if int(check("cuCtxGetCurrent", cu.cuCtxGetCurrent())) != primary:
            check("cuCtxPushCurrent", cu.cuCtxPushCurrent(cu.CUcontext(primary)))
            self.pushed = True
        return self

    def __exit__(self, *exc) -> None:
        if self.pushed:
            self.pushed = False
            check("cuCtxPopCurrent", cu.cuCtxPopCurrent())


def load_library(image: bytes):
    """Load a cubin image; the driver loads it into each context lazily, on first use."""
    init()
    return check("cuLibraryLoadData", cu.cuLibraryLoadData(image, None, None, 0, None, None, 0))


def get_kernel(library, symbol: str):
    return check(f"cuLibraryGetKernel({symbol})", cu.cuLibraryGetKernel(library, symbol.encode()))


def set_max_dynamic_smem(kernel, nbytes: int, ordinal: int) -> None:
    """Opt the kernel into `nbytes` of dynamic shared memory on one device (above 48 KB the
    driver refuses a launch without this). Device-wide, so done once per kernel at load: setting
    it around each launch would race with launches from other threads."""
    check(
        "cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        cu.cuKernelSetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            nbytes,
            kernel,
            device_handle(ordinal),
        ),
    )


_TMA_DATA_TYPES = {
    "fp16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    "bf16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    "fp32": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    "e4m3": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,  # TMA only moves its bytes
}
TENSOR_MAP_BYTES = 128


def encode_tiled_tensor_map(
    dtype: str, address: int, dims: tuple[int, ...], byte_strides: tuple[int, ...], box: tuple[int, ...]
) -> bytes:
    """The 128-byte CUtensorMap for TMA tiled loads of `box`-shaped tiles with the 128-byte
    swizzle; `dims` and `box` innermost first, `byte_strides` for dims[1:]. Out-of-bounds
    elements read as zero."""
    init()
    tensor_map = check(
        "cuTensorMapEncodeTiled",
        cu.cuTensorMapEncodeTiled(
            _TMA_DATA_TYPES[dtype],
            len(dims),
            address,
            [cu.cuuint64_t(d) for d in dims],
            [cu.cuuint64_t(s) for s in byte_strides],
            [cu.cuuint32_t(b) for b in box],
            [cu.cuuint32_t(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
    )
    return ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)


def kernel_param_array(*params: ctypes.Array | ctypes.Structure) -> tuple[ctypes.Array, int]:
    """The ``void*[]`` the driver wants: one pointer to each by-value parameter's bytes.

    Returns the array (keep it, and `params`, alive until the launch call returns; the driver
    copies the parameter bytes during the call) and its address, which cuda.bindings takes as
    the ready-made ``void**``.
    """
    pointers = (ctypes.c_void_p * len(params))(*map(ctypes.addressof, params))
    return pointers, ctypes.addressof(pointers)


# Launch configurations by (grid, block, dynamic shared memory, stream): a loop repeats them,
# and building one costs a launch a microsecond. Threads share them: the driver only reads one.
_launch_configs: dict[tuple, object] = {}
_LAUNCH_CONFIGS_KEPT = 4096  # then start over


def _launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], dynamic_smem: int, stream: int):
    key = (grid, block, dynamic_smem, stream)
    config = _launch_configs.get(key)
    if config is None:
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = dynamic_smem
        config.hStream = cu.CUstream(stream)
        config.numAttrs = 0
        if len(_launch_configs) >= _LAUNCH_CONFIGS_KEPT:
            _launch_configs.clear()
        _launch_configs[key] = config
    return config


def launch(
    kernel,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    dynamic_smem: int,
    stream: int,
    params: tuple[ctypes.Array | ctypes.Structure, ...],
) -> None:
    """Launch `kernel` with `params`, the kernel's by-value parameters in order."""
    config = _launch_config(grid, block, dynamic_smem, stream)
    # `pointers` is only held so the array outlives the call that reads it.
    pointers, address = kernel_param_array(*params)  # noqa: F841
    check("cuLaunchKernelEx", cu.cuLaunchKernelEx(config, kernel, address, 0))
