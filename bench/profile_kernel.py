"""Runs one fagen attention shape a few times: a target for `ncu` (Nsight Compute), which needs
a process that launches the kernel, nothing else.

    ncu --clock-control none --kernel-name regex:fa3 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 -m bench.profile_kernel --bundle DIR --head-dim 128 --seqlen 4096
"""

from __future__ import annotations

import argparse

import torch

from bench.attention import HIDDEN, TOTAL_TOKENS
from fagen.torch import flash_attn_func


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args(argv)
    batch, heads = TOTAL_TOKENS // args.seqlen, HIDDEN // args.head_dim
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    for _ in range(args.launches):
        flash_attn_func(q, k, v, causal=args.causal, bundle=args.bundle)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
