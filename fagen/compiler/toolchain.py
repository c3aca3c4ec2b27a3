"""Versions of the tools a bundle was built with: recorded in the manifest and hashed into keys."""

from __future__ import annotations

import functools
import platform
from importlib import metadata

from .headers import nvrtc_version


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def compiler_versions() -> dict[str, str]:
    """What decides a cubin and its SASS listing (the kernel cache key takes these only)."""
    return {
        "nvrtc": nvrtc_version(),
        # The wheel's patch level: NVRTC's API reports major.minor only, but ptxas changes within.
        "nvidia-cuda-nvrtc": _package_version("nvidia-cuda-nvrtc"),
        "nvidia-cuda-cuobjdump": _package_version("nvidia-cuda-cuobjdump"),
    }


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    return {
        **compiler_versions(),
        "cuda-bindings": _package_version("cuda-bindings"),
        "jinja2": _package_version("jinja2"),
        "python": platform.python_version(),
    }
