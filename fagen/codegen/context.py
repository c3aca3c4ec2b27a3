"""Everything a kernel template needs, computed once here from the spec.

The template re-checks the numbers it relies on with static_assert, so a template edit that
disagrees with the Python side fails at compile time instead of at run time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .. import abi
from ..spec import KernelSpec, algorithm_for
from ..spec.fa3 import PRODUCER_REGISTERS
from ..spec.fa4 import CONTROL_REGISTERS, CORRECTION_REGISTERS, SOFTMAX_REGISTERS

C_ELEMENT_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16"}


@dataclass(frozen=True)
class LaunchInfo:
    """How a host launches the kernel: grid = (ceil(seqlen_q / block_m), heads_q, batch).

    TMA kernels (tma_q_rows > 0) take a second parameter, FagenTmaMaps: Q boxes of tma_q_rows
    rows and K/V boxes of tma_kv_rows rows, 64 columns each, 128-byte swizzle.
    """

    threads: int
    block_m: int
    dynamic_smem: int
    tma_q_rows: int = 0
    tma_kv_rows: int = 0
    # Persistent kernels take grid (min(tiles, SMs x ctas_per_sm), 1, 1) and walk the tiles
    # themselves.
    persistent: bool = False
    # CTAs the kernel is compiled to keep resident per SM (__launch_bounds__ min blocks).
    ctas_per_sm: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


def launch_info(spec: KernelSpec) -> LaunchInfo:
    g = spec.geometry
    uses_tma = spec.fa_version >= 3
    return LaunchInfo(
        threads=g.threads,
        block_m=g.block_m,
        dynamic_smem=g.smem_bytes,
        tma_q_rows=g.block_m if uses_tma else 0,
        tma_kv_rows=g.block_n if uses_tma else 0,
        persistent=bool(getattr(g, "persistent", False)),
        ctas_per_sm=getattr(g, "ctas_per_sm", 1),
    )


def _softmax_options(spec: KernelSpec) -> dict:
    """The algo/online_softmax.cuh options every template takes."""
    threshold = spec.tile.rescale_threshold
    return {
        "exp2_emulation_period": spec.tile.exp2_emulation_period,
        "conditional_rescale": threshold is not None,
        "rescale_threshold": repr(float(threshold or 0.0)),
    }


def _fa2_context(spec: KernelSpec) -> dict:
    g = spec.geometry
    return {
        "warp_rows": g.warp_rows,
        "row_pitch_bytes": g.row_pitch_bytes,
        "smem_q_bytes": g.smem_q_bytes,
        "smem_kv_stage_bytes": g.smem_kv_stage_bytes,
    }


def _tma_ring_offsets(g) -> dict:
    """Shared-memory offsets of the TMA kernels' ring (fagen/spec/layout.py, TmaRingLayout)."""
    return {
        "smem_q_offset": g.smem_q_offset,
        "smem_k_offset": g.smem_k_offset,
        "smem_v_offset": g.smem_v_offset,
        "smem_barrier_offset": g.smem_barrier_offset,
    }


def _fa3_context(spec: KernelSpec) -> dict:
    g = spec.geometry
    return {
        "warp_specialized": g.warp_specialized,
        "pingpong": g.pingpong,
        "intra_wg_overlap": g.intra_wg_overlap,
        "persistent": g.persistent,
        "early_first_qk": g.early_first_qk,
        "peel_masked_blocks": g.peel_masked_blocks,
        "mma_row_sum": g.mma_row_sum,
        "pv_columns": g.pv_columns,
        "smem_v_stage_bytes": g.smem_v_stage_bytes,
        "q_stages": g.q_stages,
        "producer_registers": PRODUCER_REGISTERS,
        "consumer_registers": g.consumer_registers,
        "ctas_per_sm": g.ctas_per_sm,
        **_tma_ring_offsets(g),
    }


def _fa4_context(spec: KernelSpec) -> dict:
    g = spec.geometry
    return {
        "tmem_columns": g.tmem_columns,
        "softmax_registers": SOFTMAX_REGISTERS,
        "correction_registers": CORRECTION_REGISTERS,
        "control_registers": CONTROL_REGISTERS,
        **_tma_ring_offsets(g),
        "smem_control_bytes": g.smem_control_bytes,
    }


_ALGORITHM_CONTEXT = {2: _fa2_context, 3: _fa3_context, 4: _fa4_context}


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
        "stages": g.stages,
        "smem_bytes": g.smem_bytes,
        "abi_version": abi.ABI_VERSION,
        "abi_struct": abi.C_STRUCT_NAME,
        "abi_size": abi.struct_size(),
        "abi_offsets": list(abi.field_offsets().items()),
        **_softmax_options(spec),
        **_ALGORITHM_CONTEXT[spec.fa_version](spec),
    }
