"""Compile one rendered kernel to a cubin with NVRTC, and refuse cubins we would not ship.

NVRTC releases the GIL while compiling, so callers run compile_kernel on a thread pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import nvrtc

from ..codegen import RenderedKernel
from .errors import CompileError, ToolchainError
from .options import NvrtcOptions, options_for
from .resources import PtxasResources, parse_ptxas_log, performance_warnings

_SUCCESS = nvrtc.nvrtcResult.NVRTC_SUCCESS


@dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    log: str
    resources: PtxasResources
    seconds: float


def _check(result, what: str) -> None:
    if result != _SUCCESS:
        raise ToolchainError(f"{what} failed: {result}")


def _program_output(program, get_size, get) -> bytes:
    """One of NVRTC's sized outputs: ask its size, then fill a buffer of that size."""
    result, size = get_size(program)
    _check(result, get_size.__name__)
    buffer = b" " * size
    (result,) = get(program, buffer)
    _check(result, get.__name__)
    return buffer


def _program_log(program) -> str:
    log = _program_output(program, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
    return log.rstrip(b"\0 ").decode(errors="replace")


def _program_cubin(program) -> bytes:
    return _program_output(program, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)


def nvrtc_compile(source: str, name: str, options: NvrtcOptions) -> tuple[bytes | None, str]:
    """(cubin, log); cubin is None when NVRTC reports an error."""
    result, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(result, "nvrtcCreateProgram")
    try:
        args = options.as_nvrtc()
        (result,) = nvrtc.nvrtcCompileProgram(program, len(args), args)
        log = _program_log(program)
        if result != _SUCCESS:
            return None, log
        return _program_cubin(program), log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile_kernel(
    rendered: RenderedKernel, source_dir: Path, options: NvrtcOptions | None = None
) -> CompiledKernel:
    """Compile `rendered` into a checked cubin. Errors name its source as
    `source_dir/<name>.cu`, where the bundle writer keeps every kernel's source.

    Raises CompileError (with the NVRTC log and the path of the source on disk) when NVRTC fails,
    the cubin is empty, anything spills, or ptxas warns about performance.
    """
    source_path = Path(source_dir) / f"{rendered.name}.cu"
    options = options or options_for(rendered.spec.arch)

    start = time.perf_counter()
    cubin, log = nvrtc_compile(rendered.source, rendered.name, options)
    seconds = time.perf_counter() - start

    def fail(why: str) -> CompileError:
        return CompileError(f"{rendered.name}: {why}", log, source_path)

    if cubin is None:
        raise fail("NVRTC failed to compile the kernel")
    if not cubin:
        raise fail(f"NVRTC produced an empty cubin (options: {' '.join(options.flags)})")
    try:
        resources = parse_ptxas_log(log, rendered.name)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if resources.spill_bytes:
        raise fail(
            f"{resources.spill_store_bytes} bytes spill stores, {resources.spill_load_bytes} bytes "
            f"spill loads at {resources.registers} registers: shrink the tile (fewer rows per warp "
            "or a smaller block_n)"
        )
    if warnings := performance_warnings(log):
        raise fail("ptxas performance warning: " + " | ".join(warnings))
    return CompiledKernel(cubin=cubin, log=log, resources=resources, seconds=seconds)
