"""Varlen prefill: flash_attn_varlen_func over packed sequences against fagen's dense kernel at
the same tokens, same process (bench.attention's protocol: bf16, hidden 2048, rotating rounds,
median of triton's do_bench).

    python -m bench.varlen [--head-dims 64,128] [--seqlens 1k,4k,16k] [--tokens 16k]
                           [--direction fwd|bwd] [--repeats N] [--bundle DIR] [--json PATH]

Rows: `equal`, tokens / seqlen sequences of seqlen tokens each, packed, against the dense call
on (batch, seqlen): the issue's bar is >= 0.95x. `mixed`, sequences of seqlen / 8 ... seqlen
tokens (seeded), packed to about the same tokens, against the dense call on as many sequences
of the longest length (what padding would run): TFLOP/s are of the (query, key) pairs each call
really computes, so a varlen call whose time tracks its real tokens matches the dense TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys

import torch

from bench import cuda_missing, write_rows
from bench.attention import DIRECTION_FLOPS, HIDDEN, _int_list, median_ms, rotating_samples, tflops
from bench.window import timed
from fagen.torch import flash_attn_func, flash_attn_varlen_func, get_bundle


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def lengths_of(kind: str, seqlen: int, tokens: int, seed: int = 0) -> list[int]:
    if kind == "equal":
        return [seqlen] * max(1, tokens // seqlen)
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(rng.randint(max(1, seqlen // 8), seqlen))
    return lengths


def measure(kind: str, head_dim: int, seqlen: int, tokens: int, bundle, direction: str, repeats: int) -> dict:
    heads = HIDDEN // head_dim
    lengths = lengths_of(kind, seqlen, tokens)
    grad = direction != "fwd"
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    batch = len(lengths)
    dense = [torch.randn(batch, longest, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
             for _ in range(3)]

    def varlen(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, bundle=bundle)

    def padded(q, k, v):
        return flash_attn_func(q, k, v, causal=True, bundle=bundle)

    contenders = {"varlen": timed(direction, varlen, q, k, v, torch.randn_like(q)),
                  "dense": timed(direction, padded, *dense, torch.randn_like(dense[0]))}
    row = {"kind": kind, "head_dim": head_dim, "seqlen": seqlen, "sequences": len(lengths), "tokens": total,
           "direction": direction, "errors": {}}
    samples = rotating_samples({n: functools.partial(median_ms, fn) for n, fn in contenders.items()},
                               repeats, row["errors"])
    row["ms"] = {n: statistics.median(s) for n, s in samples.items() if s}
    pairs = {"varlen": heads * sum(causal_pairs(n) for n in lengths),
             "dense": heads * batch * causal_pairs(longest)}
    row["tflops"] = {n: tflops(4.0 * head_dim * pairs[n] * DIRECTION_FLOPS[direction], ms)
                     for n, ms in row["ms"].items()}
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| dir | kind | hd | seqlen | sequences | varlen TFLOP/s | dense TFLOP/s | varlen/dense | time / padded time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, ms = r["tflops"], r["ms"]
        ratio = f"{t['varlen'] / t['dense']:.2f}" if len(t) == 2 else "-"
        time = f"{ms['varlen'] / ms['dense']:.2f}" if len(ms) == 2 else "-"
        lines.append(f"| {r['direction']} | {r['kind']} | {r['head_dim']} | {r['seqlen']} | {r['sequences']} | "
                     f"{t.get('varlen', 0):.0f} | {t.get('dense', 0):.0f} | {ratio} | {time} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.varlen", description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=_int_list, default=[64, 128])
    parser.add_argument("--seqlens", type=_int_list, default=[1024, 4096, 16384])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if cuda_missing("bench.varlen"):
        return 2
    bundle = get_bundle(args.bundle)
    rows = []
    for kind in ("equal", "mixed"):
        for head_dim in args.head_dims:
            for seqlen in args.seqlens:
                rows.append(measure(kind, head_dim, seqlen, args.tokens, bundle, args.direction, args.repeats))
                print(f"measured {rows[-1]}", flush=True)
    if args.json_path:
        write_rows(args.json_path, rows)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
