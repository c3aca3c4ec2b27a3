"""Cold start: time from importing fagen to the first finished result, in fresh processes.

Each variant runs in its own new Python process that has already imported torch and made its
inputs on the GPU (BENCHMARKS.md "Cold start"); the child times ``import fagen.torch``, opening
the bundle, reading + verifying + loading the cubin, and the first launch up to synchronize.
torch SDPA's first call in a fresh process is measured the same way for contrast.

    python -m bench.cold_start [--bundle DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench import cuda_missing

VARIANTS = (
    {"name": "fagen hd128 causal", "impl": "fagen", "head_dim": 128, "causal": True},
    {"name": "fagen hd96 causal", "impl": "fagen", "head_dim": 96, "causal": True},
    {"name": "fagen hd192 full", "impl": "fagen", "head_dim": 192, "causal": False},
    {"name": "torch SDPA hd96 causal", "impl": "sdpa", "head_dim": 96, "causal": True},
)
BATCH, SEQLEN, HEADS = 2, 4096, 16


def child(variant: dict, bundle: str | None) -> dict:
    import torch

    q, k, v = (
        torch.randn(BATCH, SEQLEN, HEADS, variant["head_dim"], device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    torch.cuda.synchronize()
    parts = {}
    start = time.perf_counter()
    if variant["impl"] == "sdpa":
        import torch.nn.functional as F

        F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=variant["causal"]
        )
        torch.cuda.synchronize()
        parts["first call + sync"] = time.perf_counter() - start
    else:
        import fagen.torch

        parts["import fagen.torch"] = time.perf_counter() - start
        mark = time.perf_counter()
        opened = fagen.torch.get_bundle(bundle)
        parts["open bundle"] = time.perf_counter() - mark
        mark = time.perf_counter()
        key = fagen.torch.kernel_key(q.dtype, variant["head_dim"], "causal" if variant["causal"] else "full")
        opened.kernel(opened.select(key, torch.cuda.get_device_capability()))
        parts["read+verify+load cubin"] = time.perf_counter() - mark
        mark = time.perf_counter()
        fagen.torch.flash_attn_func(q, k, v, causal=variant["causal"], bundle=opened)
        torch.cuda.synchronize()
        parts["first launch + sync"] = time.perf_counter() - mark
    total = time.perf_counter() - start
    mark = time.perf_counter()
    if variant["impl"] == "fagen":
        fagen.torch.flash_attn_func(q, k, v, causal=variant["causal"], bundle=opened)
    else:
        F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=variant["causal"]
        )
    torch.cuda.synchronize()
    return {**variant, "parts_s": parts, "total_s": total, "second_call_s": time.perf_counter() - mark}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child), args.bundle)))
        return 0

    if cuda_missing("bench.cold_start"):
        return 2
    results, failed = [], False
    for variant in VARIANTS:
        command = [sys.executable, "-m", "bench.cold_start", "--child", json.dumps(variant)]
        if args.bundle:
            command += ["--bundle", args.bundle]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            failed = True
            print(f"{variant['name']}: child failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{result['name']} (bf16, batch {BATCH}, seqlen {SEQLEN}, {HEADS} heads):")
        for part, seconds in result["parts_s"].items():
            print(f"  {part:<26} {seconds * 1e3:9.1f} ms")
        print(f"  {'total':<26} {result['total_s'] * 1e3:9.1f} ms   (second call {result['second_call_s'] * 1e3:.1f} ms)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
