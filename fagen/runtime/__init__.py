"""Stage 5: load bundles and launch their kernels through the CUDA driver (cuda.bindings).

Imports neither pydantic, Jinja nor NVRTC: a deployed process needs only the bundle and
cuda-bindings.
"""

from ..bundle.format import BundleError, KernelEntry
from .driver import DriverError
from .loader import Bundle, KernelNotFound, LoadedKernel, launch_grid, load, runs_on

__all__ = [
    "Bundle", "BundleError", "DriverError", "KernelEntry", "KernelNotFound", "LoadedKernel",
    "launch_grid", "load", "runs_on",
]
