"""merge_attention_states: the fused kernel (the paged-layout kernels' merge entry point) against
the same formula as torch tensor operations, in the same process, as CUDA-graph replays (what a
server's cascade-attention step runs). GB/s of the two inputs read and the output written
(outputs in bf16, LSEs in fp32).

    FAGEN_BUNDLE=generated/default python -m bench.merge [--tokens 1,64,4096,32768] [--heads 32]
                                                          [--head-dim 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.attention import median_ms, rotating_samples, timer_name
from bench.decode import graphed
from fagen.torch import get_bundle, merge_attention_states
from fagen.torch.merge import _merge_tensors


def measure(tokens: int, heads: int, head_dim: int, bundle, repeats: int) -> dict:
    out_a, out_b = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(heads, tokens, device="cuda") for _ in range(2))
    calls = {"fused": lambda: merge_attention_states(out_a, lse_a, out_b, lse_b, bundle=bundle),
             "tensor ops": lambda: _merge_tensors(out_a, lse_a, out_b, lse_b)}
    errors = {}
    contenders = {name: (lambda replay=graphed(fn): median_ms(replay)) for name, fn in calls.items()}
    samples = rotating_samples(contenders, repeats, errors)
    moved = 3 * tokens * heads * (head_dim * 2 + 4)
    ms = {name: statistics.median(s) for name, s in samples.items()}
    return {"tokens": tokens, "heads": heads, "head_dim": head_dim, "us": {n: 1e3 * t for n, t in ms.items()},
            "gbps": {n: moved / (t * 1e-3) / 1e9 for n, t in ms.items()}, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,4096,32768")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.merge needs a CUDA device", file=sys.stderr)
        return 1
    bundle = get_bundle()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {timer_name()} of CUDA-graph replays")
    print("| tokens | heads | hd | fused µs | tensor ops µs | fused GB/s | tensor ops GB/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = measure(tokens, args.heads, args.head_dim, bundle, args.repeats)
        us, gbps = row["us"], row["gbps"]
        print(f"| {tokens} | {args.heads} | {args.head_dim} | {us['fused']:.1f} | {us['tensor ops']:.1f} | "
              f"{gbps['fused']:.0f} | {gbps['tensor ops']:.0f} | {us['tensor ops'] / us['fused']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
