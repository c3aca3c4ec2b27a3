"""Everything a kernel template needs, taken from the spec: the algorithm's model computed the
derived constants once (fagen/model/fa*.py); codegen only names them for Jinja.

The template re-checks the numbers it relies on with static_assert, so a template edit that
disagrees with the Python side fails at compile time instead of at run time.
"""

from __future__ import annotations

import json

from .. import abi, contract
from ..model import KernelSpec

C_ELEMENT_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "e4m3": "__nv_fp8_e4m3"}


def build_context(spec: KernelSpec) -> dict:
    params = abi.BwdParams if spec.direction == "bwd" else abi.FwdParams
    return {
        "kernel_name": spec.name,
        "spec_json": json.dumps(spec.model_dump(mode="json"), sort_keys=True),
        "template_path": f"templates/kernels/{spec.TEMPLATE}",
        "element_type": C_ELEMENT_TYPES[spec.dtype],
        "cache_element_type": C_ELEMENT_TYPES[spec.kv_dtype or spec.dtype],
        "output_type": C_ELEMENT_TYPES[contract.output_dtype(spec.dtype)],
        "constexprs": spec.constexprs(),
        "mask_type": spec.mask_type,
        "custom_mask_name": spec.custom_mask.name if spec.custom_mask else "",
        "custom_mask_source": spec.custom_mask.source if spec.custom_mask else "",
        "layout": spec.layout,
        "dtype": spec.dtype,
        "abi_version": abi.ABI_VERSION,
        "abi_struct": abi.C_STRUCT_NAMES[params],
        # Each struct a template's entry points take, for its static_asserts: the kernel's
        # params, and the merge entry point's (templates/kernels/fa2_fwd_paged_sm80.cu.j2).
        "abi_structs": {"params": _struct(params), "merge": _struct(abi.MergeParams)},
    }


def _struct(struct) -> dict:
    return {"name": abi.C_STRUCT_NAMES[struct], "size": abi.struct_size(struct),
            "offsets": list(abi.field_offsets(struct).items())}
