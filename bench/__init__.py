"""Benchmarks: `python -m bench.attention`, `python -m bench.cold_start`,
`python -m bench.launch_overhead`, `python -m bench.host_model` (no GPU needed)."""

from __future__ import annotations

import sys


def cuda_missing(tool: str) -> bool:
    """True, after one line on stderr, where torch sees no CUDA device (the caller exits 2)."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{tool}: needs a CUDA device (torch {torch.__version__} sees none)", file=sys.stderr)
    return True


def write_rows(path: str, rows: list[dict]) -> None:
    """A benchmark's rows as JSON at `path`, with the device and torch they ran on."""
    import json

    import torch

    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def flash_attn_4_function(name: str):
    """flash-attn-4's `name` (flash_attn.cute.interface: flash_attn_func, flash_attn_varlen_func),
    or None where it is not importable (../shared/BENCHMARKS.md says how to install it)."""
    try:
        from flash_attn.cute import interface
    except Exception:  # an import of the CuTe DSL fails in many ways where it is not installed
        return None
    return getattr(interface, name, None)


def flash_attn_4():
    """flash-attn-4's flash_attn_func returning the output alone (some versions return (out,
    lse)), or None where it is not importable."""
    fa4 = flash_attn_4_function("flash_attn_func")
    if fa4 is None:
        return None

    def output_of(*args, **kwargs):
        out = fa4(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return output_of
