"""Stage 6: the torch adapter (flash-attn's calling convention on fagen bundles)."""

from ..runtime import Bundle, BundleError, KernelNotFound
from .adapter import bundle_path, flash_attn_func, flash_attn_fwd, get_bundle, kernel_key

__all__ = [
    "Bundle", "BundleError", "KernelNotFound", "bundle_path", "flash_attn_func", "flash_attn_fwd",
    "get_bundle", "kernel_key",
]
