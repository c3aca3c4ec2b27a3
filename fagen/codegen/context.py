"""Everything a kernel template needs, computed once here from the spec.

The template re-checks the numbers it relies on with static_assert, so a template edit that
disagrees with the Python side fails at compile time instead of at run time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .. import abi
from ..spec import KernelSpec, algorithm_for

C_ELEMENT_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16"}


@dataclass(frozen=True)
class LaunchInfo:
    """How a host launches the kernel: grid = (ceil(seqlen_q / block_m), heads_q, batch)."""

    threads: int
    block_m: int
    dynamic_smem: int

    def as_dict(self) -> dict:
        return asdict(self)


def launch_info(spec: KernelSpec) -> LaunchInfo:
    g = spec.geometry
    return LaunchInfo(threads=g.threads, block_m=g.block_m, dynamic_smem=g.smem_bytes)


def build_context(spec: KernelSpec) -> dict:
    algorithm = algorithm_for(spec.fa_version, spec.direction)
    assert algorithm is not None  # the spec validated it
    g = spec.geometry
    return {
        "kernel_name": spec.name,
        "spec_json": json.dumps(spec.model_dump(mode="json"), sort_keys=True),
        "template_path": f"templates/kernels/{algorithm.template}",
        "element_type": C_ELEMENT_TYPES[spec.dtype],
        "is_bf16": spec.dtype == "bf16",
        "causal": spec.causal,
        "head_dim": g.head_dim,
        "block_m": g.block_m,
        "block_n": g.block_n,
        "warps": g.warps,
        "threads": g.threads,
        "warp_rows": g.warp_rows,
        "stages": g.stages,
        "row_pitch_bytes": g.row_pitch_bytes,
        "smem_q_bytes": g.smem_q_bytes,
        "smem_kv_stage_bytes": g.smem_kv_stage_bytes,
        "smem_bytes": g.smem_bytes,
        "abi_version": abi.ABI_VERSION,
        "abi_struct": abi.C_STRUCT_NAME,
        "abi_size": abi.struct_size(),
        "abi_offsets": list(abi.field_offsets().items()),
    }
