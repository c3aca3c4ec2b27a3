"""Stage 6: the torch adapter (flash-attn's calling convention on fagen bundles): the forward
(adapter.py), its backward and autograd (backward.py), the FP8 forward's arguments (e4m3.py),
the public call (api.py) and the call over a KV cache (kvcache.py) and over packed sequences
(varlen.py), the merge of two partial results (merge.py), and quantising to e4m3 with
incoherent processing (quantize.py)."""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as error:  # the build path needs no torch, so a plain install has none
    raise ModuleNotFoundError(
        "fagen.torch needs PyTorch: pip install torch, or pip install 'fagen[torch]'",
        name="torch") from error

from ..runtime import Bundle, BundleError, KernelNotFound
from .adapter import bundle_path, flash_attn_fwd, flash_attn_fwd_fp8, get_bundle, kernel_key
from .api import flash_attn_func
from .backward import flash_attn_bwd
from .kvcache import flash_attn_with_kvcache, get_scheduler_metadata
from .merge import merge_attention_states
from .quantize import incoherent_qk, quantize_e4m3, random_orthogonal
from .varlen import flash_attn_varlen_func

__all__ = [
    "Bundle", "BundleError", "KernelNotFound", "bundle_path", "flash_attn_bwd", "flash_attn_func",
    "flash_attn_fwd", "flash_attn_fwd_fp8", "flash_attn_varlen_func", "flash_attn_with_kvcache", "get_bundle",
    "get_scheduler_metadata", "incoherent_qk", "kernel_key", "merge_attention_states", "quantize_e4m3",
    "random_orthogonal",
]
