"""Everything a kernel template needs, taken from the spec: the algorithm's model computed the
derived constants once (fagen/model/fa*.py); codegen only names them for Jinja.

The template re-checks the numbers it relies on with static_assert, so a template edit that
disagrees with the Python side fails at compile time instead of at run time.
"""

from __future__ import annotations

import json

from .. import abi
from ..model import KernelSpec

C_ELEMENT_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16"}


def build_context(spec: KernelSpec) -> dict:
    params = abi.BwdParams if spec.direction == "bwd" else abi.FwdParams
    return {
        "kernel_name": spec.name,
        "spec_json": json.dumps(spec.model_dump(mode="json"), sort_keys=True),
        "template_path": f"templates/kernels/{spec.TEMPLATE}",
        "element_type": C_ELEMENT_TYPES[spec.dtype],
        "constexprs": spec.constexprs(),
        "mask_type": spec.mask_type,
        "custom_mask_name": spec.custom_mask.name if spec.custom_mask else "",
        "custom_mask_source": spec.custom_mask.source if spec.custom_mask else "",
        "abi_version": abi.ABI_VERSION,
        "abi_struct": abi.C_STRUCT_NAMES[params],
        "abi_size": abi.struct_size(params),
        "abi_offsets": list(abi.field_offsets(params).items()),
    }
