"""Host time per call: how long `fagen.torch.flash_attn_func` and torch SDPA keep the CPU busy
before the kernel is queued, on a shape small enough that the GPU is never the limit.

A call that costs the host more than its kernel costs the GPU leaves the GPU idle between
kernels; do_bench (bench/attention.py) hides host time only up to the ~0.1 ms its L2 flush
takes, so for short rows this number also bounds what the benchmark can show.

    python -m bench.launch_overhead [--bundle DIR] [--calls 2000] [--profile PATH]

--profile writes the cProfile statistics of fagen's calls (the top entries by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import pstats
import time

import torch
from torch.nn.attention import sdpa_kernel

from bench import cuda_missing
from bench.attention import PEERS, sdpa
from fagen.torch import flash_attn_func, get_bundle

SHAPE = (1, 128, 2, 128)  # batch, seqlen, heads, head_dim: a kernel of a few microseconds


def host_us_per_call(fn, calls: int) -> float:
    """Median over 5 bursts of `calls` calls of the host time per call (no synchronization
    inside a burst, so only the CPU side is timed while the GPU keeps up)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", help="write fagen's cProfile top entries here")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if cuda_missing("bench.launch_overhead"):
        return 2
    bundle = get_bundle(args.bundle)
    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    contenders = {"fagen": (lambda: flash_attn_func(q, k, v, causal=True, bundle=bundle), None)}
    contenders.update({f"SDPA {name}": (lambda: sdpa(q, k, v, True), backend)
                       for name, backend in PEERS.items()})
    results = {}
    for name, (fn, backend) in contenders.items():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            for _ in range(50):
                fn()
            results[name] = host_us_per_call(fn, args.calls)
        print(f"{name:12s} {results[name]:7.1f} us per call (host)")
    if args.profile:
        profiler = cProfile.Profile()
        fn = contenders["fagen"][0]
        profiler.enable()
        for _ in range(args.calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"shape": SHAPE, "calls": args.calls, "host_us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
