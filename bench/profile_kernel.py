"""Runs one fagen attention shape a few times: a target for `ncu` (Nsight Compute), which needs
a process that launches the kernel, nothing else.

    ncu --clock-control none --kernel-name regex:fa3 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 -m bench.profile_kernel --bundle DIR --head-dim 128 --seqlen 4096

--peer FA2 or --peer cuDNN launches torch SDPA with that backend instead (same shape), so the
peer's kernel can be profiled the same way (`--kernel-name regex:flash|cudnn|sdpa`).
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import sdpa_kernel

from bench.attention import HIDDEN, PEERS, TOTAL_TOKENS, sdpa
from fagen.torch import flash_attn_func


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--peer", choices=sorted(PEERS), help="profile SDPA with this backend")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args(argv)
    batch, heads = TOTAL_TOKENS // args.seqlen, HIDDEN // args.head_dim
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    if args.peer is None and args.bundle is None:
        parser.error("give --bundle or --peer")
    for _ in range(args.launches):
        if args.peer is None:
            flash_attn_func(q, k, v, causal=args.causal, bundle=args.bundle)
        else:
            with sdpa_kernel(PEERS[args.peer]):
                sdpa(q, k, v, args.causal)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
