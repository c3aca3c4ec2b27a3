"""Stage 3: compile rendered kernels to cubins with NVRTC and check what came out."""

from .cache import CachedKernel, KernelCache, tree_digest
from .errors import CompileError, ToolchainError
from .headers import bundled_include_dirs, cache_root, nvrtc_version
from .nvrtc import CompiledKernel, compile_kernel
from .options import NvrtcOptions, options_for
from .resources import PtxasResources, parse_ptxas_log
from .sass import sass_families, sass_families_of, sass_problems
from .toolchain import compiler_versions, toolchain_versions

__all__ = [
    "CachedKernel", "KernelCache", "tree_digest", "compiler_versions", "toolchain_versions",
    "CompileError", "ToolchainError", "bundled_include_dirs", "cache_root", "nvrtc_version",
    "CompiledKernel", "compile_kernel", "NvrtcOptions", "options_for", "PtxasResources",
    "parse_ptxas_log", "sass_families", "sass_families_of", "sass_problems",
]
