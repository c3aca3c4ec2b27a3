"""NVRTC's bundled CUDA headers, extracted once per NVRTC version into a shared cache.

NVRTC 13.x has no default include path; it carries the toolkit headers matching itself inside
libnvrtc-builtins. Extracting them per NVRTC version keeps two fagen installs with different
NVRTC wheels from reading each other's headers.
"""

from __future__ import annotations

import functools
from pathlib import Path

from cuda.bindings import nvrtc
from filelock import FileLock

from ..paths import cache_root  # re-exported: fagen.compiler.cache_root
from .errors import ToolchainError


def nvrtc_version() -> str:
    result, major, minor = nvrtc.nvrtcVersion()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"nvrtcVersion failed: {result}")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=None)
def bundled_include_dirs() -> tuple[Path, ...]:
    """The include dirs of NVRTC's bundled headers (`<dir>` and `<dir>/cccl`), extracting once."""
    target = cache_root() / "nvrtc-headers" / nvrtc_version()
    target.parent.mkdir(parents=True, exist_ok=True)
    # nvrtcInstallBundledHeaders locks on its own, but only around the extraction; our lock also
    # covers the check that follows, so no reader sees a half-written tree.
    with FileLock(str(target) + ".lock"):
        result, detail = nvrtc.nvrtcInstallBundledHeaders(
            str(target).encode(), int(nvrtc.NVRTC_INSTALL_HEADERS_SKIP_IF_EXISTS)
        )
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise ToolchainError(
                f"extracting NVRTC's bundled headers into {target} failed: {result} {detail or ''}"
            )
        if not (target / "cuda_fp16.h").is_file():
            raise ToolchainError(
                f"{target}: NVRTC's bundled headers are incomplete (no cuda_fp16.h); delete the "
                "directory and build again"
            )
    return tuple(d for d in (target, target / "cccl") if d.is_dir())
