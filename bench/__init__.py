"""Benchmarks: `python -m bench.attention`, `python -m bench.cold_start`,
`python -m bench.launch_overhead`."""

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
