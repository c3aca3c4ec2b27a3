"""The FlashAttention lineage on one GPU, same run: FA1 -> FA2 -> FA3 kernels of one bundle
(specs/lineage.yaml), each launched by name, on the protocol's shapes (bf16, 16k tokens, hidden
2048), next to the papers' claims.

    fagen build specs/lineage.yaml            # generated/lineage/, on any machine
    python -m bench.attention --lineage [--bundle DIR] [--seqlens ...] [--head-dims 64,128]
    fagen bench --lineage ...                 # the same

The papers' claims the table is read against: FlashAttention-2 (Dao, 2023) reports about 2x
FlashAttention-1's forward on A100; FlashAttention-3 (Shah et al., 2024) reports 1.5-2.0x
FlashAttention-2's forward on H100 (FP16/BF16).
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from bench.attention import HIDDEN, TOTAL_TOKENS, attention_flops, median_ms, tflops
from fagen import paths
from fagen.runtime import KernelNotFound, call
from fagen.torch.adapter import get_bundle, prepare_launch

ALGORITHMS = (1, 2, 3)
CLAIMS = {(2, 1): "~2x (FA2 paper, A100)", (3, 2): "1.5-2.0x (FA3 paper, H100)"}


def measure(bundle, head_dim: int, causal: bool, seqlen: int, repeats: int) -> dict:
    batch, heads = TOTAL_TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
           "nheads": heads, "tflops": {}, "kernels": {}, "errors": {}, "max_abs_diff_vs_fa3": {}}
    launches = {}
    for version in ALGORITHMS:
        try:
            problem = call.Problem("bf16", causal, batch, seqlen, seqlen, heads, heads, head_dim)
            entry = call.select(bundle, problem, q.device.index, fa_version=version)
        except KernelNotFound as exc:
            row["errors"][f"fa{version}"] = str(exc).splitlines()[0]
            continue
        launches[version] = prepare_launch(bundle, entry, q, k, v, out, lse)
        row["kernels"][f"fa{version}"] = entry.name
    reference = None
    for version in sorted(launches, reverse=True):  # check every output against the newest
        launches[version]()
        torch.cuda.synchronize()
        if reference is None:
            reference = out.clone()
        else:
            row["max_abs_diff_vs_fa3"][f"fa{version}"] = (out.float() - reference.float()).abs().max().item()
    samples = {version: [] for version in launches}
    order = list(launches)
    for round_index in range(repeats):
        shift = round_index % len(order)
        for version in order[shift:] + order[:shift]:
            samples[version].append(median_ms(launches[version]))
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    for version, times in samples.items():
        row["tflops"][f"fa{version}"] = tflops(flops, statistics.median(times))
    return row


def format_table(rows: list[dict]) -> str:
    header = (f"{'hd':>4} {'causal':>6} {'seqlen':>6} {'FA1':>6} {'FA2':>6} {'FA3':>6} "
              f"{'FA2/FA1':>8} {'FA3/FA2':>8}")
    lines = ["forward TFLOP/s, one bundle, same run (bf16, 16k tokens, hidden 2048)", header,
             "-" * len(header)]
    for row in rows:
        t = row["tflops"]
        fa1, fa2, fa3 = (t.get(f"fa{v}") for v in ALGORITHMS)

        def cell(x, width=6, digits=0):
            return f"{x:{width}.{digits}f}" if x else f"{'-':>{width}}"

        lines.append(f"{row['head_dim']:>4} {'yes' if row['causal'] else 'no':>6} {row['seqlen']:>6} "
                     f"{cell(fa1)} {cell(fa2)} {cell(fa3)} "
                     f"{cell(fa2 / fa1 if fa1 and fa2 else None, 8, 2)} "
                     f"{cell(fa3 / fa2 if fa2 and fa3 else None, 8, 2)}")
    ratios = {pair: [r["tflops"][f"fa{pair[0]}"] / r["tflops"][f"fa{pair[1]}"] for r in rows
                     if f"fa{pair[0]}" in r["tflops"] and f"fa{pair[1]}" in r["tflops"]]
              for pair in CLAIMS}
    for (new, old), claim in CLAIMS.items():
        values = ratios[(new, old)]
        if values:
            geo = math.exp(sum(map(math.log, values)) / len(values))
            lines.append(f"FA{new}/FA{old}: {min(values):.2f}-{max(values):.2f}x, geometric mean "
                         f"{geo:.2f}x over {len(values)} rows; paper: {claim}")
    for row in rows:
        for name, text in row["errors"].items():
            lines.append(f"  hd{row['head_dim']} s{row['seqlen']} {name}: {text}")
    return "\n".join(lines)


def main(args) -> int:
    if not torch.cuda.is_available():
        print("fagen bench --lineage: needs a CUDA device", file=sys.stderr)
        return 2
    bundle = get_bundle(args.bundle or paths.generated_dir() / "lineage")
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for head_dim in args.head_dims:
        for causal in causal_values:
            for seqlen in args.seqlens:
                row = measure(bundle, head_dim, causal, seqlen, args.repeats)
                rows.append(row)
                print(f"measured hd{head_dim} {'causal' if causal else 'full'} s{seqlen}: "
                      + ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()), flush=True)
    table = format_table(rows)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "bundle": str(bundle.path), "repeats": args.repeats},
                       "rows": rows}, f, indent=1)
    if args.table_path:
        with open(args.table_path, "w") as f:
            f.write(table + "\n")
    print(table)
    # bf16 outputs of three algorithms agree to about 2^-8 of their magnitude (~1e-2 here).
    worst = max((d for r in rows for d in r["max_abs_diff_vs_fa3"].values()), default=0.0)
    return 1 if worst > 5e-2 else 0
