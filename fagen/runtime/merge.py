"""merge_attention_states on device pointers, no torch: the attention over two disjoint key sets
from each one's output and LSE, by the merge entry point that every paged-layout kernel's cubin
carries (templates/include/fagen/algo/merge_states.cuh; fagen/contract.py: SPLIT_MERGE_SUFFIX).
One launch, no host synchronisation: a prepared merge can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .. import contract
from ..abi import MergeParams
from ..contract import ALIGNMENT_BYTES, KernelEntry
from . import driver
from .call import AttentionError, Tensor, _check_tensor
from .loader import Bundle, KernelNotFound, LoadedKernel, _preference, runs_on

# The merge moves rows as 16-byte vectors of 2-byte elements.
MERGE_HEAD_DIM_MULTIPLE = 8


@dataclass(frozen=True)
class States:
    """One attention result: out (batch, seqlen, heads, head_dim) in elements' strides (packed
    rows: batch 1, batch stride 0), and its fp32 LSE (batch, heads, seqlen) at `lse`, a row's
    entries contiguous."""

    out: Tensor
    lse: int
    lse_batch_stride: int
    lse_head_stride: int


@dataclass(frozen=True)
class PreparedMerge:
    kernel: LoadedKernel
    grid: tuple[int, int, int]
    params: bytes  # FagenMergeParams
    device: int

    def enqueue(self, stream: int) -> None:
        """Launch on `stream`, the device's primary context current."""
        self.kernel.enqueue_companion(contract.SPLIT_MERGE_SUFFIX, MergeParams.from_buffer_copy(self.params),
                                      self.grid, contract.COMPANION_THREADS, stream)

    def launch(self, stream: int) -> None:
        with driver.primary_context(self.device):
            self.enqueue(stream)


def merge_kernel(bundle: Bundle, dtype: str, compute_capability: tuple[int, int]) -> KernelEntry:
    """A paged-layout kernel of `dtype` that runs on the device: its cubin's merge entry point
    serves every head dim."""
    found = _merge_kernel(bundle, dtype, tuple(compute_capability))
    if found is None:
        major, minor = compute_capability
        raise KernelNotFound(
            f"merge_attention_states runs in a paged-layout kernel's cubin, and bundle {bundle.path} has none of "
            f"dtype {dtype} for sm_{major}{minor}; build one, e.g. a spec with {{fa_version: 2, arch: "
            f"sm{major}{minor}, dtype: {dtype}, head_dim: 128, layout: paged, mask: local}}")
    return found


@functools.lru_cache(maxsize=64)
def _merge_kernel(bundle: Bundle, dtype: str, compute_capability: tuple[int, int]) -> KernelEntry | None:
    """merge_kernel's choice, once per bundle, dtype and device kind (an open Bundle never
    changes): every merge of a decoding step asks it."""
    found = [e for e in bundle.kernels
             if e.launch.grid == "splits" and e.key.split("/")[1] == dtype and runs_on(e, compute_capability)]
    return max(found, key=_preference) if found else None


def prepare_merge(bundle: Bundle, dtype: str, batch: int, seqlen: int, heads: int, head_dim: int,
                  a: States, b: States, out: States, device: int = 0,
                  entry: KernelEntry | None = None) -> PreparedMerge:
    """Check a merge of `a` and `b` into `out` (out.lse 0: no LSE written; out may alias a or
    b) and build its launch; `entry`: merge_kernel's, where the caller asked it already. Raises
    AttentionError, KernelNotFound."""
    for name, value in (("batch", batch), ("seqlen", seqlen), ("heads", heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AttentionError(f"{name}={value!r}: a size, >= 0")
    if head_dim % MERGE_HEAD_DIM_MULTIPLE:
        raise AttentionError(f"head_dim={head_dim}: the merge needs a multiple of {MERGE_HEAD_DIM_MULTIPLE}")
    for name, states in (("a", a), ("b", b), ("out", out)):
        _check_tensor(f"out_{name}" if name != "out" else "out", states.out, False)
        if (states.lse == 0 and name != "out") or states.lse % 4:
            raise AttentionError(f"lse_{name}: a 4-byte aligned fp32 device array")
    if any(s.out.data % ALIGNMENT_BYTES for s in (a, b, out)):
        raise AttentionError(f"the outputs must be {ALIGNMENT_BYTES}-byte aligned")
    entry = entry or merge_kernel(bundle, dtype, driver.compute_capability(device))
    params = MergeParams(out_a=a.out.data, lse_a=a.lse, out_b=b.out.data, lse_b=b.lse, out=out.out.data,
                         lse=out.lse or None, batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim)
    for prefix, states in (("out_a", a), ("out_b", b), ("out", out)):
        for dim, stride in zip(("batch", "row", "head"), states.out.strides):
            setattr(params, f"{prefix}_{dim}_stride", stride)
    for prefix, states in (("lse_a", a), ("lse_b", b), ("lse_out", out)):
        setattr(params, f"{prefix}_batch_stride", states.lse_batch_stride)
        setattr(params, f"{prefix}_head_stride", states.lse_head_stride)
    return PreparedMerge(bundle.kernel(entry), contract.companion_grid(batch, seqlen, heads), bytes(params), device)
